"""Run tests/test_flood.py's flooded run in a loop to catch its rare hang, and dump where it hangs.

  PYTHONFAULTHANDLER=1 .venv/bin/python tools/flood_loop.py 30 [--out /tmp/flood_loop]

Each run: a 3-rank cpu run of the test's length, its control port and rendezvous store flooded as
the test floods them, rank 2 SIGKILLed once the store flood is up. A run that has not ended 60 s
after the kill is taken as hung: the launcher gets SIGABRT, so under PYTHONFAULTHANDLER=1 every
thread's Python stack goes to <out>/<run>/launcher_out.txt (the ranks, left without a launcher,
exit). Beside two CPU hogs (`python3 -c "while True: pass"`) a hang came about once in 20-60
runs (docs/decisions.md, "Still open: the flood test can hang")."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_flood import flooded_run_without_rank_2  # noqa: E402

HUNG_AFTER_S = 60.0


def one_run(folder: Path) -> str:
    """'completed' (or the run's other status), 'hung' (stacks dumped), 'hung: no start event'
    (the ranks never all joined) or 'ended before the kill'."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        with flooded_run_without_rank_2(folder) as (proc, _, _):
            deadline = time.monotonic() + HUNG_AFTER_S
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGABRT)
                out, _ = proc.communicate(timeout=30)
                (folder / "launcher_out.txt").write_text(out)
                return "hung"
            proc.communicate(timeout=30)
    except ProcessLookupError:
        return "ended before the kill"
    except AssertionError as exc:  # a step of the run that never came (the launcher is killed)
        return f"hung: {exc}"
    return json.loads((folder / "run" / "summary.json").read_text())["status"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=int)
    parser.add_argument("--out", default="/tmp/flood_loop")
    args = parser.parse_args()
    tally: dict = {}
    for i in range(args.runs):
        outcome = one_run(Path(args.out) / str(i))
        tally[outcome] = tally.get(outcome, 0) + 1
        print(f"run {i}: {outcome}", flush=True)
        if outcome == "hung":
            print(f"stacks: {Path(args.out) / str(i) / 'launcher_out.txt'}")
        if outcome.startswith("hung"):
            break
    print(json.dumps(tally))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
