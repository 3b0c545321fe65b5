"""The zoo's matrix: every zoo recipe (conf/recipe/zoo_*.yaml), eager and compiled, solo and in
every mode with two ranks, on this machine's CPU or on one GPU that both ranks share; then,
with --speed, the solo path's training time against a careful user's own loop, side by side.

    .venv/bin/python tools/zoo_matrix.py                          # CPU ranks, eager, every cell
    python3 tools/zoo_matrix.py --device cuda --compiled --speed  # the GPU machine (tools/device_run.sh)

Each cell is a real run (`python -m flodl_run recipe=zoo_X ...`, tracking off) whose summary.json
gives its status, final eval and training samples/s. Two ranks on one GPU run the coordinator
modes as they are and the collective modes over Gloo (cluster.backend=gloo): NCCL needs one GPU
per rank. The speed rounds alternate the two loops (A B A B ...) and compare medians, since a
machine's speed drifts within a call. Writes matrix.json and matrix.md into --out; exit 1 when a
cell failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
PATHS = ["solo", "nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"]
COLLECTIVE = {"nccl_sync", "nccl_cadence"}


def zoo_names() -> List[str]:
    return sorted(p.stem for p in (REPO / "conf" / "recipe").glob("zoo_*.yaml"))


def cell_overrides(path: str, device: str, compiled: bool) -> List[str]:
    """The overrides of one cell: where its ranks run and how its model is built."""
    if path == "solo":
        out = ["cluster=solo", f"device={device}"]
    elif device == "cuda":
        out = ["cluster=local_gpus", "cluster.devices=[0,0]", f"elche={path}"]
        out += ["cluster.backend=gloo"] if path in COLLECTIVE else []
    else:
        out = ["cluster=cpu", "cluster.num_ranks=2", f"elche={path}"]
    if compiled:
        out.append(f"recipe.compile={'inductor' if device == 'cuda' else 'aot_eager'}")
    return out


def run_cell(name: str, overrides: List[str], epochs: int, run_dir: Path, timeout_s: float) -> Dict:
    """One run to its end: the summary's figures, or the failure's last lines."""
    cmd = [sys.executable, "-m", "flodl_run", f"recipe={name}", f"num_epochs={epochs}", "tracking=off",
           f"hydra.run.dir={run_dir}", *overrides]
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        tail = (proc.stderr or proc.stdout)[-600:]
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout_s:.0f} s", "wall_s": timeout_s}
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    row = {"status": summary.get("status", f"exit {proc.returncode}"), "eval": summary.get("final_eval"),
           "samples_per_s": summary.get("samples_per_s"), "wall_s": time.perf_counter() - began}
    if row["status"] != "completed":
        row["message"] = summary.get("message")
        row["tail"] = tail + "".join(_error_lines(log) for log in sorted(run_dir.glob("ranks/*.log")))
    return row


def _error_lines(log: Path) -> str:
    """The lines of a rank's log that say what failed (the error, not Hydra's warnings)."""
    lines = log.read_text(errors="replace").splitlines()
    hits = [line for line in lines if "Error" in line or "error" in line or "raise" in line]
    return f"\n{log.name}: " + "\n".join(hits[-6:])


def speed_rounds(name: str, device: str, epochs: int, compiled: bool, rounds: int, out: Path) -> Dict:
    """The solo path (flodl_run.train, in-process) and a careful user's own loop, alternated
    `rounds` times in one process: each one's median training ms per epoch (the first epoch,
    warm-up and compile, left out; our eval left out), and own / ours."""
    cmd = [sys.executable, str(REPO / "tools" / "zoo_speed.py"), name, "--device", device,
           "--epochs", str(epochs), "--rounds", str(rounds), "--out", str(out / "speed")]
    proc = subprocess.run(cmd + (["--compiled"] if compiled else []), cwd=REPO, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return {"ours_ms": None, "own_loop_ms": None, "ratio": None, "error": proc.stderr[-600:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(cells: Dict, speed: Dict) -> str:
    lines = ["| model | build | " + " | ".join(PATHS) + " |", "|---|---|" + "---|" * len(PATHS)]
    for (name, build), row in cells.items():
        cols = []
        for path in PATHS:
            cell = row.get(path)
            if cell is None:
                cols.append("-")
            elif cell["status"] == "completed":
                cols.append(f"ok {cell['eval']:.3f}" if cell["eval"] is not None else "ok")
            else:
                cols.append(f"**{cell['status']}**")
        lines.append(f"| {name} | {build} | " + " | ".join(cols) + " |")
    if speed:
        lines += ["", "| model | build | solo path ms/epoch | own loop ms/epoch | own loop / ours |",
                  "|---|---|---|---|---|"]
        for (name, build), s in speed.items():
            ours = "-" if s["ours_ms"] is None else f"{s['ours_ms']:.1f}"
            ratio = "-" if s["ratio"] is None else f"{s['ratio']:.2f}x"
            own = "-" if s["own_loop_ms"] is None else f"{s['own_loop_ms']:.1f}"
            lines.append(f"| {name} | {build} | {ours} | {own} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--compiled", action="store_true", help="also every model compiled")
    parser.add_argument("--speed", action="store_true", help="solo path vs own loop, interleaved")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs/zoo_matrix"))
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--jobs", type=int, default=1, help="cells run side by side")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.models.split(",") if n] or zoo_names()
    builds = [False, True] if args.compiled else [False]
    cells: Dict = {}
    todo = [(name, compiled, path) for name in names for compiled in builds
            for path in args.paths.split(",")]

    def one(item):
        name, compiled, path = item
        build = "compiled" if compiled else "eager"
        run_dir = out / f"{name}-{build[0]}-{path}"
        cell = run_cell(name, cell_overrides(path, args.device, compiled), args.epochs, run_dir,
                        args.timeout)
        print(f"{name:18s} {build:8s} {path:13s} {cell['status']:10s} eval {cell.get('eval')} "
              f"{cell['wall_s']:.0f} s", flush=True)
        if cell["status"] != "completed":
            print(cell.get("tail", ""), flush=True)
        return (name, build), path, cell

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # cells side by side (not the speed)
        for key, path, cell in pool.map(one, todo):
            cells.setdefault(key, {})[path] = cell
    speed = {}
    if args.speed:
        for name in names:
            for compiled in builds:
                speed[(name, "compiled" if compiled else "eager")] = s = speed_rounds(
                    name, args.device, max(args.epochs, 3), compiled, args.rounds, out)
                print(f"speed {name} {'compiled' if compiled else 'eager'}: {s}", flush=True)
    table = markdown(cells, speed)
    (out / "matrix.md").write_text(table)
    (out / "matrix.json").write_text(json.dumps(
        {"cells": {f"{n}/{b}": r for (n, b), r in cells.items()},
         "speed": {f"{n}/{b}": s for (n, b), s in speed.items()}}, indent=1))
    print(table)
    failed = [k for k, row in cells.items() for c in row.values() if c["status"] != "completed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
