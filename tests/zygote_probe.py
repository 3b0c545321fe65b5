"""`python -m tests.zygote_probe LOG`: the spare zygote forked from this process
(`zygote.prefork`, as `python -m flodl_run` forks its own) forks one rank under an environment
that lacks the rank's connection keys (RANK=0, WORLD_SIZE=2 only), then is sealed. Prints one
JSON line: whether the zygote was the spare, the rank's output, its exit code and the
zygote's.

Run from a launcher forked from the tests' launch server, the spare starts with torch and the
rank's modules imported: a zygote started as a new interpreter spends about 4 CPU-s importing
them for a rank that stops at its environment check."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from flodl_run.launch import zygote

RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FLODL_RUN_COORD",
             "FLODL_RUN_SECRET", "FLODL_RUN_FILE")


def main(log: Path) -> None:
    zygote.prefork()
    spare = zygote._spare is not None
    env = {**{k: v for k, v in os.environ.items() if k not in RANK_KEYS}, "RANK": "0", "WORLD_SIZE": "2"}
    found = zygote.Zygote.start(env, log)
    rank = found.spawn(env)
    found.seal()
    output = rank.stdout.read()
    deadline = time.monotonic() + 60  # bounded: the rank's exit is reported after its output ends
    while rank.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"spare": spare, "output": output, "code": rank.poll(),
                      "zygote": found.process.wait(timeout=60)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
