"""`python -m tests.preload_probe PRELOAD... -- RUN...`: a launch server forked from this
process (`launchserver.prefork`, the bench's way) is told to preload the modules PRELOAD...;
then each module RUN... is run through it as `python -m RUN`. Prints one JSON line: whether
the server was forked, and for each run its exit code, its output and whether the server was
alive after it.

Run from a launcher forked from the tests' launch server, the server it forks starts with
torch and the rank's modules imported: a test of the preload's handling of one module
spends no interpreter's start on importing everything else (about 4 CPU-s)."""

from __future__ import annotations

import json
import os
import sys

from flodl_run.launch import launchserver


def main(preload: list, run: list) -> None:
    launchserver.prefork()
    server = launchserver.preforked()
    runs = []
    if server is not None:
        server.warm(preload)
        for module in run:
            _, code, out, err = server.run([], os.getcwd(), dict(os.environ), 120, module=module)
            runs.append({"module": module, "code": code, "out": out, "err": err,
                         "alive": server.alive()})
        launchserver.dismiss()
    print(json.dumps({"forked": server is not None, "runs": runs}))


if __name__ == "__main__":
    cut = sys.argv.index("--")
    main(sys.argv[1:cut], sys.argv[cut + 1:])
