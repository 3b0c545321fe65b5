"""The rank process: one replica on one device, driven by the coordinator's orders.

Entry point `python -m flodl_run.rank`, torchrun-compatible: reads RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, plus FLODL_RUN_COORD (coordinator address),
FLODL_RUN_SECRET (hex key) and FLODL_RUN_FILE (the resolved run.yaml). It trains what it is
told, reduces when told, and reports facts; it decides nothing about cadence. This module is
the process around the runner: it reads the environment and the run file, runs RankRunner
(rank.runner) and reports a failure once, to the coordinator and on stderr.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import zmq

from flodl_run.averaging.shm import PREFIX_ENV, remove_run
from flodl_run.config.compose import experiment_from_yaml
from flodl_run.contracts.recipe import raised_by_recipe, user_traceback
from flodl_run.contracts.signals import ignore_stop_signal
from flodl_run.contracts.wire import Channel, RankFailed, connect_dealer
from flodl_run.rank.env import RankEnv, end_own_group, is_orphaned, watch_orphaned
from flodl_run.rank.runner import RankRunner

__all__ = ["RankEnv", "RankRunner", "main"]


def main() -> int:
    """Run one rank; an exception (the recipe's, or ours) or the recipe's sys.exit is reported
    to the coordinator and printed once (`rank 1: failed:`, the traces of the code that raised
    it, then the one error line), and the rank exits 1."""
    ignore_stop_signal(os.environ)  # the launcher's to act on (a scheduler signals us all)
    env = RankEnv.from_environ(dict(os.environ))
    watch_orphaned(env)
    os.environ.pop("FLODL_RUN_SECRET", None)  # read: what the recipe starts must not inherit it
    config = experiment_from_yaml(env.run_file.read_text())
    runner: Optional[RankRunner] = None
    try:
        runner = RankRunner(env, config)
        return runner.run()
    except (Exception, SystemExit) as exc:
        if isinstance(exc, SystemExit) and not raised_by_recipe(exc):
            raise  # ours: a rank the coordinator declared dead leaves with its message
        error = _error_line(exc)
        when = "failed" if runner is not None else "failed to start"
        trace = user_traceback(exc, error)  # empty where the message says where: one line then
        print(f"rank {env.rank}: {when}:\n{trace}" if trace else f"rank {env.rank}: {when}: {error}\n",
              file=sys.stderr, end="")
        _report_failure(env, runner, RankFailed(env.rank, error))
        return 1
    finally:
        if runner is not None:
            runner.close()
        if is_orphaned(env):  # however we got here (a broken output pipe, ...): no slab stays,
            remove_run(os.environ.get(PREFIX_ENV))  # nor anything the recipe started
            end_own_group()


def _error_line(exc: BaseException) -> str:
    """`ValueError: ...`; a recipe's sys.exit is a recipe error too, named as one (it used to
    end the rank with code 0, taken for a lost rank, and the run completed)."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: the recipe called sys.exit({exc.code!r}); a recipe ends its rank by raising"
    return f"{type(exc).__name__}: {exc}"


def _report_failure(env: RankEnv, runner: Optional[RankRunner], failed: RankFailed) -> None:
    """Tell the coordinator (a runner that failed to start has no channel yet: open one)."""
    if runner is not None and hasattr(runner, "channel"):
        runner.channel.send(failed)
        return
    ctx = zmq.Context()
    sock = connect_dealer(ctx, env.coord, env.secret, linger_ms=1000)
    Channel(sock, env.secret).send(failed)
    ctx.destroy()  # delivered (or given up after the linger) before the rank exits


if __name__ == "__main__":
    sys.exit(main())
