"""A pytest plugin that writes each test's CPU time (the whole machine's busy jiffies while the
test ran, so the launchers, ranks and daemons it started are counted) and wall time, to find
what makes the suite slow. Run it on an otherwise idle machine, one worker:

  PYTHONPATH=tools .venv/bin/python -m pytest -n 0 -p pytest_cpu -q [tests...]
  sort -rn outputs/test_cpu.tsv | head -30          # cpu_s, wall_s, test id, worker, start

The suite is CPU-bound on 2 cores (about 85% busy in a whole run), so the CPU column, not the
wall one, says what a test costs the suite.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

OUT = Path("outputs/test_cpu.tsv")


def _busy_s() -> float:
    """Seconds of CPU the machine spent busy since boot (all cores; idle and iowait left out)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / 100.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy, began = _busy_s(), time.monotonic()
    yield
    OUT.parent.mkdir(exist_ok=True)
    with OUT.open("a") as out:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
        out.write(f"{_busy_s() - busy:.2f}\t{time.monotonic() - began:.2f}\t{item.nodeid}"
                  f"\t{worker}\t{began:.2f}\n")
