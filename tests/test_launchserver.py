"""The launch server (flodl_run/launch/launchserver.py): a launcher forked from it sees what one
started by `python -m flodl_run` sees."""

from __future__ import annotations

import json
import os

import pytest

from tests.support import _run, run_module

RECIPE = '''
import json, os, sys
with open(os.environ["SEEN_FILE"], "a") as seen:
    seen.write(json.dumps({"cwd": os.getcwd(), "path": sys.path, "argv0": sys.argv[0],
                           "env": os.environ.get("SEEN_MARK"), "main": sys.modules["__main__"].__spec__.name,
                           "stdio": [[type(f.buffer).__name__, f.line_buffering, f.write_through]
                                     for f in (sys.stdout, sys.stderr)],
                           "stdin": sys.stdin.read()}) + "\\n")
from recipes.digits_mlp import *  # noqa: F401,F403  (the contract, from the default recipe)
'''


@pytest.mark.e2e
def test_a_forked_launcher_sees_what_a_fresh_interpreter_sees(tmp_path, monkeypatch):
    """Pins the launch server's promise: the same run, forked and in a fresh interpreter, gets
    the same working directory, the request's PYTHONPATH right after it on sys.path, the
    request's environment, `-m flodl_run`'s argv[0] and __main__, stdout and stderr buffered as
    an interpreter buffers pipes, and an empty stdin; and the same exit code and summary status."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "seen_recipe.py").write_text(RECIPE)
    seen = tmp_path / "seen.jsonl"
    outcomes = []
    for fresh in ("1", "0"):
        monkeypatch.setenv("FLODL_TESTS_FRESH", fresh)
        env = dict(os.environ, PYTHONPATH=str(pkg), SEEN_FILE=str(seen), SEEN_MARK=f"mark-{fresh}")
        proc, summary = _run(tmp_path / fresh, "cluster=solo", "num_epochs=1", "recipe=custom",
                             "recipe.module=seen_recipe", env=env)
        outcomes.append((proc.returncode, summary.get("status")))
    fresh_view, forked_view = [json.loads(line) for line in seen.read_text().splitlines()]
    assert outcomes == [(0, "completed")] * 2
    assert fresh_view["env"] == "mark-1" and forked_view["env"] == "mark-0"
    for view in (fresh_view, forked_view):
        view.pop("env")
    assert forked_view == fresh_view
    assert str(pkg) in fresh_view["path"] and fresh_view["main"] == "flodl_run.__main__"


@pytest.mark.e2e
def test_a_module_that_does_not_import_is_left_out_of_the_preload_and_the_server_serves():
    """Pins the preload as a head start, never a condition: a server told to preload a module
    that is not installed (as mlflow was not on a GPU host with tracking off), or to call a
    function that is not there, still forks launchers, and one that imports the missing module
    itself fails in its own output; a `module:function` that is there was called before the
    fork. The server is forked from a launcher
    of this worker's (tests/preload_probe.py), as the bench forks its own, and preloads with
    the same `preload`: one spawned here imported torch and the rank's modules for about 4
    CPU-s before it read its first request."""
    probe = run_module("tests.preload_probe", "flodl_missing_module_for_the_test", "platform",
                       "platform:no_such_function", "tests.preload_mark:mark", "--",
                       "platform", "flodl_missing_module_for_the_test", "tests.preload_mark", timeout=120)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    seen = json.loads(probe.stdout.splitlines()[-1])
    assert seen["forked"], seen
    served, missing, marked = seen["runs"]
    assert served["code"] == 0 and served["out"].strip() and served["alive"], served
    assert missing["code"] == 1 and missing["alive"], missing
    assert "No module named flodl_missing_module_for_the_test" in missing["err"], missing
    assert marked["code"] == 0 and marked["out"].strip() == "True", marked


@pytest.mark.e2e
def test_a_ctrl_c_while_the_server_forks_still_hands_over_the_launcher(monkeypatch):
    """Pins Ctrl-C during `start`: the launcher the server forked meanwhile is not lost (a
    bench pressed Ctrl-C in that moment died with -2 and left its run to the server); the
    KeyboardInterrupt comes with its handle, and it is waited for like any other."""
    from flodl_run.launch.launchserver import StartInterrupted
    from tests.support import REPO, launch_server

    server = launch_server()
    message = server._message
    calls = []

    def interrupted_once(*args, **kwargs):  # the terminal's SIGINT, before the reply was read
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return message(*args, **kwargs)

    monkeypatch.setattr(server, "_message", interrupted_once)
    with pytest.raises(StartInterrupted) as stopped:
        server.start([], str(REPO), dict(os.environ), module="platform")
    monkeypatch.undo()
    launched = stopped.value.launched
    assert server.running[launched.pid] is launched
    out, _ = launched.communicate(timeout=120)
    assert launched.returncode == 0 and out.strip(), out
