"""The live dashboard (`dashboard.serve`): served by the launcher during a real 2-rank run,
read over plain HTTP and in a real headless browser; its config rules and its port rule."""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from flodl_run.config.materialize import ConfigError
from flodl_run.config.schema import ExperimentConfig
from flodl_run.config.validate import validate
from flodl_run.report.liveserver import LiveServer
from tests.support import _chromium, needs_chromium, run_cli, start_cli

REPO = Path(__file__).resolve().parents[1]
URL_LINE = re.compile(r"dashboard: (http://127\.0\.0\.1:\d+/) \(live")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def _state(url: str) -> dict:
    return json.loads(_get(url + "state.json"))


def _await(condition, what: str, within_s: float = 120.0):
    """Poll `condition()` until it returns something truthy (the run's own pace decides)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, cores_held):
    """A 2-rank CPU run (cpu_pair: one rank 2.5x slower) long enough to be read while it goes;
    the last test stops it with Ctrl-C. Yields the URL, the process, its run dir and output."""
    run_dir = tmp_path_factory.mktemp("live") / "run"
    proc = start_cli("cluster=cpu_pair", "tracking=off", "num_epochs=3000", "dashboard.serve=0",
                     "dashboard_html=dashboard.html", f"hydra.run.dir={run_dir}")
    lines: "queue.Queue[str]" = queue.Queue()
    output: list = []

    def read() -> None:
        for line in proc.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                match = URL_LINE.search(lines.get(timeout=1))
            except queue.Empty:
                continue
            url = match and match.group(1)
        assert url, "".join(output)
        # Both ranks have reported a window: the page has something per rank to show.
        # One poll judges both: before the run's start sets the world size, the state lists
        # only the ranks that reported a window (none at first: `all` of nothing is true), and
        # a second poll may then see the world size of a run whose slow rank has no window yet.
        def both_ranks_windowed() -> bool:
            state = _state(url)
            ranks = state["ranks"]
            return state["world_size"] == len(ranks) == 2 and all(r["windows"] for r in ranks)

        _await(both_ranks_windowed, "both ranks' first windows")
        yield {"url": url, "proc": proc, "run_dir": run_dir, "output": output}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.e2e
def test_state_endpoint_moves_between_two_polls_during_the_run(live_run):
    """Pins the JSON endpoint: while the run goes, two polls see the state advance (version,
    per-rank windows), each rank with a positive throughput and its host, and status running."""
    url = live_run["url"]
    first = _state(url)
    windows = sum(r["windows"] for r in first["ranks"])
    # The version also moves on events that are not windows (an epoch's end, a memory sample), so
    # the poll waits for the windows themselves to advance.
    second = _await(lambda: (lambda s: s if sum(r["windows"] for r in s["ranks"]) > windows else None)(
        _state(url)), "the ranks' windows to advance")
    assert second["version"] > first["version"]
    assert first["status"] == second["status"] == "running"
    assert [r["rank"] for r in second["ranks"]] == [0, 1]
    assert all(r["throughput"] > 0 and r["host"] for r in second["ranks"])
    assert all(r["device_bytes"] == 0 for r in second["ranks"])  # CPU ranks hold no VRAM


@pytest.mark.e2e
@needs_chromium
def test_headless_chromium_shows_rank_tabs_and_throughput_while_the_run_goes(live_run, tmp_path):
    """Pins the live page in a real browser: the DOM has a tab per rank, a throughput number in
    samples/s, and the page's own poller has re-fetched the body from the server (data-polls),
    all while the run is still going."""
    dom = _chromium("--dump-dom", "--virtual-time-budget=4000", live_run["url"], tmp_path=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert live_run["proc"].poll() is None, "the run ended before the page was read"
    html = dom.stdout
    for rank in (0, 1):
        assert f'id="rank-tab-{rank}"' in html and f">rank {rank}</label>" in html
    rates = re.findall(r'class="num throughput">([\d,]+) samples/s<', html)
    assert len(rates) == 2 and all(int(r.replace(",", "")) > 0 for r in rates), rates
    polls = re.search(r'data-polls="(\d+)"', html)
    assert polls and int(polls.group(1)) >= 1, "the page's poller never refreshed it"
    assert "status-running" in html


@pytest.mark.e2e
def test_ctrl_c_stops_the_server_and_the_file_keeps_the_same_tabs(live_run):
    """Pins the end of a live run: Ctrl-C ends the launcher, the port refuses connections, and
    the teardown file (same renderer, no script) holds the per-rank tabs."""
    proc, url = live_run["proc"], live_run["url"]
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    output = "".join(live_run["output"])
    assert json.loads((live_run["run_dir"] / "summary.json").read_text())["status"] == "interrupted"
    with pytest.raises(urllib.error.URLError):
        _get(url + "state.json")
    html = (live_run["run_dir"] / "dashboard.html").read_text()
    assert 'id="rank-tab-1"' in html and "<script" not in html, output[-2000:]
    assert output.count("dashboard: http://") == 1


@pytest.mark.e2e
def test_port_in_use_is_a_config_error_before_anything_starts(tmp_path):
    """Pins the port rule: `dashboard.serve` on a port someone holds exits 2 with the dotted
    key, the port and the reason, no traceback, and no rank started."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = run_cli("cluster=cpu_pair", "tracking=off", "num_epochs=1", f"dashboard.serve={port}",
                       f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "dashboard.serve: must be a port free on 127.0.0.1" in output and str(port) in output
    assert "Traceback" not in output and "ddp:" not in output


def test_bind_refuses_a_held_port_and_frees_its_own_on_stop():
    """Pins the server's socket lifetime in-process (API runs reuse the process): a held port
    is a ConfigError naming dashboard.serve; a stopped server's port can be bound again."""
    config = ExperimentConfig()
    config.dashboard.serve = 0
    from flodl_run.report.dashboard import Dashboard

    server = LiveServer.bind(config.dashboard).start(Dashboard(None))
    port = server.sock.getsockname()[1]
    assert _state(server.url)["status"] == "running"
    config.dashboard.serve = port
    with pytest.raises(ConfigError, match="dashboard.serve"):
        LiveServer.bind(config.dashboard)
    server.stop()
    again = LiveServer.bind(config.dashboard)  # SO_REUSEADDR, as any run binds it
    again.stop()


@pytest.mark.parametrize("key, value, rule", [
    ("serve", 70000, "must be in [0, 65535]"),
    ("serve", -1, "must be in [0, 65535]"),
    ("host", " ", "must be an address to listen on"),
])
def test_dashboard_keys_are_validated_with_their_dotted_names(key, value, rule):
    """Pins the config rules: a bad port or empty host names `dashboard.<key>` and the rule."""
    config = ExperimentConfig()
    setattr(config.dashboard, key, value)
    problems = [str(p) for p in validate(config).problems]
    assert any(p.startswith(f"dashboard.{key}: {rule}") for p in problems), problems


@pytest.mark.e2e
def test_the_web_stack_loads_only_when_a_dashboard_is_served():
    """Pins the lazy import: the launcher, dashboard and live server modules import without
    starlette or uvicorn (GPU hosts may run without mlflow's web dependencies)."""
    code = ("import sys, flodl_run.launch.launcher, flodl_run.report.dashboard, flodl_run.report.liveserver; "
            "print(sorted(m for m in ('starlette', 'uvicorn') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_ranks_are_labelled_with_their_worker_hosts_in_a_multi_host_run():
    """Pins the multi-host view: with topology hosts, each rank's tab and state carry the
    worker host it runs on (ranks in worker order), as the coordinator reports them all."""
    from flodl_run.config.schema import ClusterConfig, Topology, WorkerConfig
    from flodl_run.report.dashboard import Dashboard

    config = ExperimentConfig(cluster=ClusterConfig(topology=Topology.hosts, workers=[
        WorkerConfig(host="gpu-a.test", local_devices=["cpu", "cpu"]),
        WorkerConfig(host="gpu-b.test", local_devices=["cpu"], docker="trainer")]))
    board = Dashboard(None, cluster=config.cluster)
    board.on_start(2, 10, 3)
    for rank in range(3):
        board.on_window(rank, 640, 20.0 * (rank + 1), 2**30 * rank)
    ranks = board.state()["ranks"]
    assert [r["host"] for r in ranks] == ["gpu-a.test", "gpu-a.test", "gpu-b.test"]
    assert [r["throughput"] for r in ranks] == pytest.approx([32000.0, 16000.0, 640 / 0.060], abs=1e-3)
    body = board.body()
    assert body.count('name="rank-tab"') == 3 and "gpu-b.test" in body and "2.00 GiB" in body
