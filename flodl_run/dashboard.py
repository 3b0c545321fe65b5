"""The dashboard (`dashboard_html`): one self-contained HTML file at teardown.

Owns collecting what the Observer hooks report and laying it out: the run's outcome, loss and
eval curves, per-rank throughput and batch share, anchor, phase and sync time over reduces, and
the events. Charts are inline SVG (`svgchart`), the theme is CSS (light, dark, or the viewer's
preference with auto); the file needs no network and no script. Never fails a run: a file that
cannot be written is warned about.
"""

from __future__ import annotations

import logging
import os
import time
from html import escape
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from flodl_run.config.schema import ExperimentConfig
from flodl_run.observe import Observer
from flodl_run.phase import Phase
from flodl_run.summary import EpochRecord, ReduceRecord, ReportRecord, Summary
from flodl_run.svgchart import Series, line_chart

log = logging.getLogger(__name__)

MAX_EVENT_ROWS = 500  # newest kept; the record log and MLflow's events.jsonl hold them all
PHASES = [p.name.lower() for p in sorted(Phase)]

STYLE = """
:root{--bg:#ffffff;--fg:#1f2328;--muted:#656d76;--grid:#d8dee4;--panel:#f6f8fa;
--c0:#0969da;--c1:#cf222e;--c2:#1a7f37;--c3:#9a6700;--c4:#8250df;--c5:#bf3989;--c6:#0a7a8a;--c7:#57606a}
:root[data-theme=dark]{--bg:#0d1117;--fg:#e6edf3;--muted:#8d96a0;--grid:#30363d;--panel:#161b22;
--c0:#58a6ff;--c1:#ff7b72;--c2:#3fb950;--c3:#d29922;--c4:#bc8cff;--c5:#ff80c8;--c6:#39c5cf;--c7:#b1bac4}
@media (prefers-color-scheme:dark){:root[data-theme=auto]{--bg:#0d1117;--fg:#e6edf3;--muted:#8d96a0;
--grid:#30363d;--panel:#161b22;--c0:#58a6ff;--c1:#ff7b72;--c2:#3fb950;--c3:#d29922;--c4:#bc8cff;
--c5:#ff80c8;--c6:#39c5cf;--c7:#b1bac4}}
body{background:var(--bg);color:var(--fg);font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;
margin:24px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}
.muted{color:var(--muted);fill:var(--muted);font-size:12px}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px;text-align:left;
border-bottom:1px solid var(--grid)}th{color:var(--muted);font-weight:600}
.grid-charts{display:flex;flex-wrap:wrap;gap:16px}
.chart{background:var(--panel);border-radius:6px;max-width:100%;height:auto}
.chart .title{fill:var(--fg);font-weight:600;font-size:13px}
.chart .tick{fill:var(--muted);font-size:11px}.chart .grid{stroke:var(--grid);stroke-width:1}
.chart .line{fill:none;stroke-width:2}.chart .dot{stroke:none}
.status-completed{color:var(--c2)}.status-failed,.status-shutdown_with_save{color:var(--c1)}
.status-interrupted{color:var(--c3)}
""" + "".join(f".s{i}.line{{stroke:var(--c{i})}}.s{i}.dot,.s{i}.swatch{{fill:var(--c{i})}}"
              for i in range(8))


class Dashboard(Observer):
    """Collects the hooks' records; `finish(summary, run_dir)` writes the HTML file."""

    def __init__(self, path: Path, theme: str = "auto", title: str = "flodl_run",
                 details: Optional[Dict[str, str]] = None):
        self.path, self.theme, self.title = Path(path), theme, title
        self.details = dict(details or {})
        self.epochs: List[EpochRecord] = []
        self.reduces: List[ReduceRecord] = []
        self.reports: List[ReportRecord] = []
        self.events: List[Tuple[float, str, str]] = []
        self._started = time.time()

    @classmethod
    def for_run(cls, config: ExperimentConfig, run_dir: Path) -> Optional["Dashboard"]:
        """The run's dashboard, or None when `dashboard_html` is unset (relative to the run dir)."""
        if not config.dashboard_html:
            return None
        details = {"mode": config.elche.mode.value, "outer": config.outer.kind.value,
                   "recipe": config.recipe.module, "run dir": str(run_dir)}
        return cls(Path(run_dir) / config.dashboard_html, config.dashboard_theme.value,
                   config.run_name or "flodl_run", details)

    def on_start(self, total_epochs: int, batches_per_epoch: int, world_size: int) -> None:
        self._started = time.time()

    def on_epoch(self, record: EpochRecord) -> None:
        self.epochs.append(record)

    def on_reduce(self, record: ReduceRecord) -> None:
        self.reduces.append(record)

    def on_report(self, record: ReportRecord) -> None:
        self.reports.append(record)

    def on_event(self, kind: str, message: str) -> None:
        self.events.append((time.time() - self._started, kind, message))

    def finish(self, summary: Summary, run_dir: Path) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(self.render(summary), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("dashboard %s not written: %s", self.path, exc)

    # ---- layout -----------------------------------------------------------------------------

    def render(self, summary: Summary) -> str:
        body = [f"<h1>{escape(self.title)}</h1>",
                f'<div class="muted">generated {time.strftime("%Y-%m-%d %H:%M:%S")}</div>',
                "<h2>Outcome</h2>", self._outcome(summary),
                "<h2>Training</h2>", '<div class="grid-charts">', *self._training_charts(),
                "</div>", "<h2>Ranks</h2>", '<div class="grid-charts">', *self._rank_charts(),
                "</div>"]
        if self.reduces:
            body += ["<h2>ElChe over reduces</h2>", '<div class="grid-charts">',
                     *self._reduce_charts(), "</div>"]
        body += ["<h2>Events</h2>", self._events_table()]
        return (f'<!DOCTYPE html>\n<html lang="en" data-theme="{escape(self.theme)}"><head>'
                f'<meta charset="utf-8"><meta name="viewport" content="width=device-width">'
                f'<title>{escape(self.title)}</title><style>{STYLE}</style></head>'
                f'<body>{"".join(body)}</body></html>\n')

    def _outcome(self, s: Summary) -> str:
        rows: List[Tuple[str, Any]] = [
            ("status", f'<span class="status-{escape(s.status)}">{escape(s.status)}</span>'
             + (f" ({escape(s.message)})" if s.message else "")),
            *[(k, escape(v)) for k, v in self.details.items()],
            ("world size", s.world_size), ("devices", escape(", ".join(s.devices)) or "-"),
            ("epochs", len(s.epochs) or len(self.epochs)),
            ("final eval", _num(s.final_eval)), ("wall", f"{s.wall_s:,.1f} s"),
            ("samples/s", f"{s.samples_per_s:,.0f}"),
            ("syncs", f"{s.syncs} ({s.avg_sync_ms:.2f} ms avg)"), ("phase", s.phase or "-"),
            ("dead ranks", ", ".join(map(str, s.dead_ranks)) or "-"),
            ("MLflow run", escape(s.mlflow_run_id or "-")),
        ]
        return "<table>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"

    def _training_charts(self) -> List[str]:
        epoch_x = [e.epoch + 1 for e in self.epochs]
        loss = [Series("epoch mean", epoch_x, [e.avg_loss for e in self.epochs])]
        if self.reports:
            loss.append(Series("sub-epoch", [r.epoch + r.fraction for r in self.reports],
                               [r.avg_loss for r in self.reports]))
        charts = [line_chart("loss", loss, "epoch"),
                  line_chart("eval", [Series("eval", epoch_x, [e.eval for e in self.epochs])], "epoch")]
        names = sorted({k for e in self.epochs for k in e.scalars})
        if names:
            charts.append(line_chart("user scalars", [
                Series(n, epoch_x, [e.scalars.get(n) for e in self.epochs]) for n in names], "epoch"))
        return charts

    def _rank_charts(self) -> List[str]:
        epoch_x = [e.epoch + 1 for e in self.epochs]
        ranks = max((len(e.per_rank_throughput) for e in self.epochs), default=0)

        def per_rank(field: str) -> List[Series]:
            return [Series(f"rank {r}", epoch_x,
                           [_at(getattr(e, field), r) for e in self.epochs]) for r in range(ranks)]

        return [line_chart("throughput (samples/s)", per_rank("per_rank_throughput"), "epoch"),
                line_chart("batch share", per_rank("per_rank_batch_share"), "epoch")]

    def _reduce_charts(self) -> List[str]:
        x = [r.round for r in self.reduces]
        phase = [float(PHASES.index(r.phase)) if r.phase in PHASES else None for r in self.reduces]
        ranks = max(len(r.batch_counts) for r in self.reduces)
        return [
            line_chart("anchor (batches)", [Series("anchor", x, [r.anchor for r in self.reduces])],
                       "reduce", step=True),
            line_chart("phase", [Series("phase", x, phase)], "reduce", step=True, y_labels=PHASES),
            line_chart("batch counts", [Series(f"rank {k}", x, [_at(r.batch_counts, k) for r in self.reduces])
                                        for k in range(ranks)], "reduce", step=True),
            line_chart("sync (ms)", [Series("sync ms", x, [r.sync_ms for r in self.reduces])], "reduce"),
        ]

    def _events_table(self) -> str:
        if not self.events:
            return '<div class="muted">no events</div>'
        shown = self.events[-MAX_EVENT_ROWS:]
        note = (f'<div class="muted">newest {len(shown)} of {len(self.events)}</div>'
                if len(shown) < len(self.events) else "")
        rows = "".join(f"<tr><td>{t:,.1f} s</td><td>{escape(kind)}</td><td>{escape(msg)}</td></tr>"
                       for t, kind, msg in shown)
        return f"{note}<table><tr><th>at</th><th>kind</th><th>message</th></tr>{rows}</table>"


def _at(values: List[Any], i: int) -> Optional[float]:
    return float(values[i]) if i < len(values) and values[i] is not None else None


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"

