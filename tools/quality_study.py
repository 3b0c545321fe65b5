"""Quality of the modes on a transformer, side by side on a many-core CPU machine: byte_lm_cpu
on a CPU rig, for several seeds, every entry's final eval and its time to torch DDP's final
eval of the same seed (`x DDP to quality`, docs/benchmarks.md), as medians over the seeds.

  python3 tools/quality_study.py run OUT RIG [--seeds 0 1 2] [--epochs 3] [--evals-per-epoch 4]
      [--recipe-overrides recipe.params.max_bytes=100000 ...] [--parts peers cadence]
      [--variant NAME:OVERRIDE;OVERRIDE ...] [--jobs 12]
  python3 tools/quality_study.py table OUT [OUT ...]

`run` starts two benches per seed at once (one rank per core, 4 cores a seed): one with torch
DDP, torch local SGD and nccl_sync, one with nccl_cadence under each outer (none, diloco,
slowmo) and no peers (no bare solo loops: the study needs no ideal). The second bench's
entries are set against the first's DDP bar by
`table`, which reads every OUT/<rig>/seed<k>/<part>/bench.json and prints the markdown table.
RIG: `homogeneous` (cluster=cpu, 2 one-thread ranks) or `pair` (cluster=cpu_pair, [1.0, 2.5]).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from flodl_run.report.quality import NOT_REACHED, speedup, time_to_bar

RIGS = {"homogeneous": ["cluster=cpu", "cluster.num_ranks=2", "cluster.threads_per_rank=1"],
        "pair": ["cluster=cpu_pair"]}
PARTS = {
    "peers": ["bench.modes=[nccl_sync]", "bench.outers=[none]", "bench.solo=false",
              "bench.runner_solo=false"],
    "cadence": ["bench.modes=[nccl_cadence]", "bench.outers=[none,diloco,slowmo]",
                "bench.solo=false", "bench.runner_solo=false", "bench.torch_ddp=false",
                "bench.torch_localsgd=false"],
}


CADENCE_ONLY = PARTS["cadence"][2:]


def variant_parts(specs: List[str]) -> Dict[str, List[str]]:
    """`NAME:OVERRIDE;OVERRIDE...` -> a part that runs only nccl_cadence with those overrides.
    `bench.*` overrides go to the bench; any other (a run's key, e.g.
    `elche.reduce_optimizer_state=true`) joins `bench.overrides`, which every run of the bench
    takes (`moments:elche.reduce_optimizer_state=true` is nccl_cadence with outer=none so)."""
    parts = {}
    for spec in specs:
        name, _, text = spec.partition(":")
        given = [o for o in text.split(";") if o]
        bench = [o for o in given if o.startswith(("bench.", "+bench.", "~bench."))]
        runs = [o for o in given if o not in bench]
        parts[name] = ["bench.modes=[nccl_cadence]", *CADENCE_ONLY, *_with_run_overrides(bench, runs)]
    return parts


def _with_run_overrides(bench: List[str], runs: List[str]) -> List[str]:
    """`bench` with `runs` appended to its bench.overrides list (one made when it has none)."""
    if not runs:
        return bench
    quoted = ",".join(f"'{o}'" for o in runs)
    for i, item in enumerate(bench):
        key, _, value = item.partition("=")
        if key == "bench.overrides" and value.startswith("[") and value.endswith("]"):
            inner = value[1:-1].strip()
            bench[i] = f"bench.overrides=[{inner + ',' if inner else ''}{quoted}]"
            return bench
    return [*bench, f"bench.overrides=[{quoted}]"]


def _chosen(parts: Optional[List[str]], variants: List[str]) -> Dict[str, List[str]]:
    """The benches of a seed: the standard parts asked for (both without --variant), then the
    variants."""
    names = parts if parts is not None else ([] if variants else list(PARTS))
    return {**{name: PARTS[name] for name in names}, **variant_parts(variants)}


def run(out: Path, rig: str, seeds: List[int], epochs: int, evals: int,
        recipe_overrides: List[str], parts: Dict[str, List[str]], jobs: int) -> int:
    quoted = ",".join(f"'{o}'" for o in recipe_overrides)
    recipe = f"bench.recipes=[{{name:byte_lm_cpu,overrides:[{quoted}]}}]"
    procs = []
    for seed in seeds:
        for part, extra in parts.items():
            while sum(p.poll() is None for _, p in procs) >= jobs:
                time.sleep(1)
            folder = out / rig / f"seed{seed}" / part
            folder.mkdir(parents=True, exist_ok=True)
            argv = [sys.executable, "-m", "flodl_run.bench", *RIGS[rig],
                    recipe, f"bench.epochs={epochs}",
                    f"bench.evals_per_epoch={evals}", f"bench.seed={seed}", *extra,
                    "tracking=off", f"hydra.run.dir={folder}"]
            log = open(folder / "stdout.log", "w")
            procs.append((folder, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)))
    bad = [str(folder) for folder, p in procs if p.wait() != 0]
    for folder in bad:
        print(f"failed: {folder}: {(Path(folder) / 'stdout.log').read_text()[-1500:]}")
    return 1 if bad else 0


def _points(entry: Dict) -> List:
    points = [(e["train_s"], e["eval"]) for e in entry["epochs"] if e["eval"] is not None]
    if entry["epochs"] and entry["epochs"][-1]["eval"] is None and entry["final_eval"] is not None:
        points.append((entry["epochs"][-1]["train_s"], entry["final_eval"]))
    return points


def table(outs: List[Path]) -> None:
    for out in outs:
        for rig_dir in sorted(p for p in out.iterdir() if p.is_dir()):
            rows: Dict[str, Dict[str, list]] = {}
            for seed_dir in sorted(rig_dir.glob("seed*")):
                entries = [(f.parent.name, e) for f in sorted(seed_dir.glob("*/bench.json"))
                           for e in json.loads(f.read_text())["entries"]]
                ddp = next((e for _, e in entries if e["name"] == "torch_ddp"), None)
                if ddp is None or ddp["final_eval"] is None:
                    print(f"{seed_dir}: no torch_ddp eval, skipped")
                    continue
                bar, ddp_s = ddp["final_eval"], time_to_bar(_points(ddp), ddp["final_eval"], "min")
                for part, e in entries:
                    if e["kind"] == "solo" or e["status"] != "completed":
                        continue
                    name = e["name"] if part in PARTS else part
                    row = rows.setdefault(name, {"eval": [], "x": [], "sps": []})
                    row["eval"].append(e["final_eval"])
                    row["x"].append(speedup(ddp_s, time_to_bar(_points(e), bar, "min")))
                    row["sps"].append(e["samples_per_s"])
            print(f"\n{rig_dir.name} ({out}): medians over {len(list(rig_dir.glob('seed*')))} seeds")
            print("| entry | final eval (bits/byte) | x DDP to quality | reached | samples/s |")
            print("|---|---|---|---|---|")
            for name, r in rows.items():
                reached = [x for x in r["x"] if isinstance(x, (int, float))]
                x = (f"{statistics.median([*reached, *[0.0] * (len(r['x']) - len(reached))]):.2f}"
                     if len(reached) * 2 > len(r["x"]) else NOT_REACHED)
                evals = ", ".join(f"{v:.3f}" for v in r["eval"])
                print(f"| {name} | {statistics.median(r['eval']):.3f} ({evals}) | {x} | "
                      f"{len(reached)}/{len(r['x'])} | {statistics.median(r['sps']):,.0f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("rig", choices=sorted(RIGS))
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--epochs", type=int, default=3)
    r.add_argument("--evals-per-epoch", type=int, default=4)
    r.add_argument("--recipe-overrides", nargs="*", default=[],
                   help="overrides of every run, e.g. recipe.params.max_bytes=100000")
    r.add_argument("--variant", nargs="*", default=[],
                   help="NAME:OVERRIDE;OVERRIDE...: run only these nccl_cadence benches "
                        "(e.g. 'slowmo_m05:bench.outers=[slowmo];bench.overrides=[outer.momentum=0.5]'"
                        " or 'moments:elche.reduce_optimizer_state=true'; a run's keys join "
                        "bench.overrides)")
    r.add_argument("--parts", nargs="*", choices=sorted(PARTS), default=None,
                   help="which of the two standard benches to run (default: both, or none "
                        "when --variant is given)")
    r.add_argument("--jobs", type=int, default=12, help="benches at once (2 cores each)")
    t = sub.add_parser("table")
    t.add_argument("outs", type=Path, nargs="+")
    args = parser.parse_args()
    if args.cmd == "run":
        return run(args.out, args.rig, args.seeds, args.epochs, args.evals_per_epoch,
                   args.recipe_overrides,
                   _chosen(args.parts, args.variant), args.jobs)
    table(args.outs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
