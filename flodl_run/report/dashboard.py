"""The dashboard: one self-contained HTML file at teardown (`dashboard_html`), and the same
page served live while the run goes (`dashboard.serve`, see `liveserver`).

Owns collecting what the Observer hooks report (thread-safe: the coordinator thread writes,
the live server's thread reads) and laying it out: the run's outcome, loss and eval curves,
per-rank tabs (host, throughput, batch share, VRAM, anchor rank, device busy over time), the
ranks' shares beside their devices' busy percent, anchor, phase and sync time over reduces,
and the events. One renderer serves both: the file is `page()`, the live page is
the same body that a short script re-fetches. Charts are inline SVG (`svgchart`), the theme is
CSS (light, dark, or the viewer's preference with auto); the file needs no network and no
script. Never fails a run: a file that cannot be written is warned about.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from html import escape
from pathlib import Path
from typing import Any, Deque, Dict, List, Optional, Tuple

from flodl_run.config.schema import ClusterConfig
from flodl_run.contracts.summary import EpochRecord, ReduceRecord, ReportRecord, Summary
from flodl_run.elche.phase import Phase
from flodl_run.observe.observer import Observer
from flodl_run.report.records import rank_hosts
from flodl_run.report.svgchart import Series, line_chart

log = logging.getLogger(__name__)

MAX_EVENT_ROWS = 500  # newest kept; the record log and MLflow's events.jsonl hold them all
LIVE_EVENT_ROWS = 50  # the live page re-sends its body each poll: the newest events only
WINDOW_POINTS = 600   # per rank, newest windows kept for the throughput-over-time chart
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
.tabs{display:flex;flex-wrap:wrap;gap:0 4px}.tabs>input{position:absolute;opacity:0}
.tabs>label{padding:5px 12px;border:1px solid var(--grid);border-bottom:none;border-radius:6px 6px 0 0;
cursor:pointer;color:var(--muted)}.tabs>input:checked+label{background:var(--panel);color:var(--fg);
font-weight:600}.tabs>.panel{display:none;order:1;width:100%;background:var(--panel);padding:12px;
border-radius:0 6px 6px 6px}.num{font-variant-numeric:tabular-nums}
""" + "".join(f".s{i}.line{{stroke:var(--c{i})}}.s{i}.dot,.s{i}.swatch{{fill:var(--c{i})}}"
              for i in range(8))


class Dashboard(Observer):
    """Collects the hooks' records; `finish(summary, run_dir)` writes the HTML file (when it
    has a path) and `page()`, `body()` and `state()` read a consistent copy at any time."""

    output = "the dashboard page"

    def __init__(self, path: Optional[Path], theme: str = "auto", title: str = "flodl_run",
                 details: Optional[Dict[str, str]] = None,
                 cluster: Optional[ClusterConfig] = None):
        self.path = None if path is None else Path(path)
        self.theme, self.title, self.cluster = theme, title, cluster
        self.details = dict(details or {})
        self.epochs: List[EpochRecord] = []
        self.reduces: List[ReduceRecord] = []
        self.reports: List[ReportRecord] = []
        self.events: List[Tuple[float, str, str]] = []
        self.windows: Dict[int, Deque[Tuple[float, float]]] = {}
        """Per rank: (seconds since start, samples/s of compute) of its newest windows."""
        self.device_bytes: Dict[int, int] = {}
        self.busy: Dict[int, Deque[Tuple[float, float]]] = {}
        """Per rank: (seconds since start, its device's busy percent) of its newest beats."""
        self.hosts: List[str] = []
        self.world_size = 0
        self.total_epochs = 0
        self.summary: Optional[Summary] = None
        self.version = 0
        """Bumped by every hook: a reader re-renders only when it moved."""
        self._lock = threading.Lock()
        self._started = time.time()

    # ---- hooks (the coordinator's thread) ---------------------------------------------------

    def _changed(self) -> None:
        self.version += 1

    def on_start(self, total_epochs: int, batches_per_epoch: int, world_size: int) -> None:
        with self._lock:
            self._started = time.time()
            self.total_epochs, self.world_size = total_epochs, world_size
            self.hosts = (rank_hosts(self.cluster, world_size, socket.gethostname())
                          if self.cluster is not None else [])
            self._changed()

    def on_window(self, rank: int, samples: int, wall_ms: float, device_bytes: int) -> None:
        if wall_ms <= 0:
            return
        with self._lock:
            points = self.windows.setdefault(rank, deque(maxlen=WINDOW_POINTS))
            points.append((time.time() - self._started, samples * 1000.0 / wall_ms))
            self.device_bytes[rank] = device_bytes
            self._changed()

    def on_busy(self, rank: int, busy_percent: float) -> None:
        with self._lock:
            points = self.busy.setdefault(rank, deque(maxlen=WINDOW_POINTS))
            points.append((time.time() - self._started, busy_percent))
            self._changed()

    def on_epoch(self, record: EpochRecord) -> None:
        with self._lock:
            self.epochs.append(record)
            self._changed()

    def on_reduce(self, record: ReduceRecord) -> None:
        with self._lock:
            self.reduces.append(record)
            self._changed()

    def on_report(self, record: ReportRecord) -> None:
        with self._lock:
            self.reports.append(record)
            self._changed()

    def on_event(self, kind: str, message: str) -> None:
        with self._lock:
            self.events.append((time.time() - self._started, kind, message))
            self._changed()

    def finish(self, summary: Summary, run_dir: Path) -> None:
        with self._lock:
            self.summary = summary
            self._changed()
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(self.render(summary), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("dashboard %s not written: %s", self.path, exc)

    # ---- reading (any thread) ---------------------------------------------------------------

    def _copy(self) -> "Dashboard":
        """A frozen copy of what was collected, so a reader renders without holding the lock."""
        with self._lock:
            copy = Dashboard(self.path, self.theme, self.title, self.details, self.cluster)
            copy.epochs, copy.reduces = list(self.epochs), list(self.reduces)
            copy.reports, copy.events = list(self.reports), list(self.events)
            copy.windows = {r: deque(p) for r, p in self.windows.items()}
            copy.busy = {r: deque(p) for r, p in self.busy.items()}
            copy.device_bytes, copy.hosts = dict(self.device_bytes), list(self.hosts)
            copy.world_size, copy.total_epochs = self.world_size, self.total_epochs
            copy.summary, copy.version, copy._started = self.summary, self.version, self._started
        return copy

    def body(self, max_events: int = LIVE_EVENT_ROWS) -> str:
        """The page's body as it stands now (the final one once `finish` ran)."""
        copy = self._copy()
        return copy._body(copy.summary, max_events)

    def page(self, script: str = "") -> str:
        """The whole page as it stands now; `script` is appended (the live page's poller)."""
        copy = self._copy()
        return copy._page(copy._body(copy.summary, LIVE_EVENT_ROWS), script)

    def state(self) -> Dict[str, Any]:
        """What the page shows, as JSON-ready data (the live server's `/state.json`)."""
        copy = self._copy()
        last = copy.reduces[-1] if copy.reduces else None
        return {"version": copy.version,
                "status": copy.summary.status if copy.summary else "running",
                "elapsed_s": round(time.time() - copy._started, 3),
                "world_size": copy.world_size, "total_epochs": copy.total_epochs,
                "epochs_done": len(copy.epochs), "reduces": len(copy.reduces),
                "anchor": last.anchor if last else None, "phase": last.phase if last else None,
                "ranks": [copy._rank_state(r) for r in range(copy._ranks())],
                "events": [{"at_s": round(t, 3), "kind": k, "message": m}
                           for t, k, m in copy.events[-LIVE_EVENT_ROWS:]]}

    # ---- layout -----------------------------------------------------------------------------

    def render(self, summary: Summary) -> str:
        """The end-of-run file: every event up to MAX_EVENT_ROWS, no script."""
        return self._page(self._body(summary, MAX_EVENT_ROWS))

    def _page(self, body: str, script: str = "") -> str:
        return (f'<!DOCTYPE html>\n<html lang="en" data-theme="{escape(self.theme)}"><head>'
                f'<meta charset="utf-8"><meta name="viewport" content="width=device-width">'
                f'<title>{escape(self.title)}</title><style>{STYLE}</style></head>'
                f'<body><div id="live">{body}</div>{script}</body></html>\n')

    def _body(self, summary: Optional[Summary], max_events: int) -> str:
        stamp = "generated" if summary is not None else "live, updated"
        body = [f"<h1>{escape(self.title)}</h1>",
                f'<div class="muted">{stamp} {time.strftime("%Y-%m-%d %H:%M:%S")}</div>',
                "<h2>Outcome</h2>", self._outcome(summary),
                "<h2>Training</h2>", '<div class="grid-charts">', *self._training_charts(),
                "</div>", "<h2>Ranks</h2>", self._rank_tabs(), '<div class="grid-charts">',
                *self._rank_charts(), "</div>"]
        if self.reduces:
            body += ["<h2>ElChe over reduces</h2>", '<div class="grid-charts">',
                     *self._reduce_charts(), "</div>"]
        body += ["<h2>Events</h2>", self._events_table(max_events)]
        return "".join(body)

    def _outcome(self, s: Optional[Summary]) -> str:
        if s is None:
            return self._progress_table()
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
        return _table(rows)

    def _progress_table(self) -> str:
        """The outcome table's place while the run goes."""
        last = self.reduces[-1] if self.reduces else None
        rates = [p[-1][1] for p in self.windows.values() if p]
        rows: List[Tuple[str, Any]] = [
            ("status", '<span class="status-running">running</span>'),
            *[(k, escape(v)) for k, v in self.details.items()],
            ("world size", self.world_size or "-"),
            ("epochs", f"{len(self.epochs)} of {self.total_epochs}"),
            ("elapsed", f"{time.time() - self._started:,.1f} s"),
            ("samples/s", f'<span class="num">{sum(rates):,.0f}</span>' if rates else "-"),
            ("reduces", len(self.reduces)),
            ("anchor", "-" if last is None else f"{last.anchor} (rank {last.anchor_rank})"),
            ("phase", "-" if last is None else escape(last.phase)),
        ]
        return _table(rows)

    def _ranks(self) -> int:
        return max([self.world_size, *(len(e.per_rank_throughput) for e in self.epochs),
                    *(r + 1 for r in self.windows)], default=0)

    def _rank_state(self, rank: int) -> Dict[str, Any]:
        points = self.windows.get(rank)
        last_epoch = self.epochs[-1] if self.epochs else None
        last_reduce = self.reduces[-1] if self.reduces else None
        return {"rank": rank, "host": _at_str(self.hosts, rank),
                "throughput": round(points[-1][1], 3) if points else None,
                "epoch_throughput": _at(last_epoch.per_rank_throughput, rank) if last_epoch else None,
                "batch_share": _at(last_epoch.per_rank_batch_share, rank) if last_epoch else None,
                "device_bytes": self.device_bytes.get(rank),
                "batches_planned": _at(last_reduce.batch_counts, rank) if last_reduce else None,
                "anchor_rank": bool(last_reduce and last_reduce.anchor_rank == rank),
                "busy_percent": self.busy[rank][-1][1] if self.busy.get(rank) else None,
                "windows": len(points or ())}

    def _rank_tabs(self) -> str:
        """One tab per rank (radio inputs and CSS: no script), the first one open."""
        ranks = self._ranks()
        if not ranks:
            return '<div class="muted">no ranks yet</div>'
        rules = "".join(f"#rank-tab-{r}:checked~#rank-panel-{r}{{display:block}}" for r in range(ranks))
        heads, panels = [], []
        for r in range(ranks):
            checked = " checked" if r == 0 else ""
            heads.append(f'<input type="radio" name="rank-tab" id="rank-tab-{r}"{checked}>'
                         f'<label for="rank-tab-{r}">rank {r}</label>')
            panels.append(f'<div class="panel" id="rank-panel-{r}">{self._rank_panel(r)}</div>')
        return f'<style>{rules}</style><div class="tabs">{"".join(heads + panels)}</div>'

    def _rank_panel(self, rank: int) -> str:
        st = self._rank_state(rank)
        vram = st["device_bytes"]
        rows: List[Tuple[str, Any]] = [
            ("host", escape(st["host"] or "-")),
            ("throughput", f'<span class="num throughput">{_rate(st["throughput"])}</span>'
                           + " (last window)"),
            ("epoch throughput", _rate(st["epoch_throughput"])),
            ("batch share", "-" if st["batch_share"] is None else f'{st["batch_share"]:.1%}'),
            ("VRAM", "cpu" if vram == 0 else "-" if vram is None else f"{vram / 2**30:,.2f} GiB"),
            ("next window", "-" if st["batches_planned"] is None
             else f'{st["batches_planned"]:.0f} batches'),
            ("anchor rank", "yes" if st["anchor_rank"] else "no"),
        ]
        charts = [line_chart(title, [Series(f"rank {rank}", [t for t, _ in pts], [v for _, v in pts])],
                             "seconds")
                  for title, pts in ((f"rank {rank} throughput (samples/s)", self.windows.get(rank)),
                                     (f"rank {rank} device busy (%)", self.busy.get(rank))) if pts]
        return _table(rows) + "".join(charts)

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

        charts = [line_chart("throughput (samples/s)", per_rank("per_rank_throughput"), "epoch"),
                  line_chart("batch share", per_rank("per_rank_batch_share"), "epoch")]
        if self.busy:  # beside the share: whether a rank's device kept up with what it was given
            charts.append(line_chart("device busy (%)", [
                Series(f"rank {r}", [t for t, _ in self.busy[r]], [v for _, v in self.busy[r]])
                for r in sorted(self.busy)], "seconds"))
        return charts

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

    def _events_table(self, max_rows: int) -> str:
        if not self.events:
            return '<div class="muted">no events</div>'
        shown = self.events[-max_rows:]
        note = (f'<div class="muted">newest {len(shown)} of {len(self.events)}</div>'
                if len(shown) < len(self.events) else "")
        rows = "".join(f"<tr><td>{t:,.1f} s</td><td>{escape(kind)}</td><td>{escape(msg)}</td></tr>"
                       for t, kind, msg in shown)
        return f"{note}<table><tr><th>at</th><th>kind</th><th>message</th></tr>{rows}</table>"


def _at(values: List[Any], i: int) -> Optional[float]:
    return float(values[i]) if i < len(values) and values[i] is not None else None


def _at_str(values: List[str], i: int) -> Optional[str]:
    return values[i] if i < len(values) else None


def _rate(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.0f} samples/s"


def _table(rows: List[Tuple[str, Any]]) -> str:
    return "<table>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"

