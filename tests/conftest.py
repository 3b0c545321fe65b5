"""Shared fixtures, the test tiers, and how the suite runs.

Tiers (markers, registered in pyproject.toml): `e2e` tests start real processes (the CLI, rank
processes, torchrun, sshd, an MLflow server); `coordinator` tests drive a real Coordinator in
this process against scripted ranks; every other test is `unit` (the mark is given here).
`-m unit` runs in seconds, `-m "not e2e"` adds the coordinator tier. A new test that starts a
process is marked e2e (per test, or `pytestmark` when a whole module is).

Running: the plain `python -m pytest` runs every test, spread over pytest-xdist workers, one per
core and one more (`-n logical --dist loadgroup` in pyproject.toml, counted by
`pytest_xdist_auto_num_workers` below). An end-to-end run spends most of its time importing
torch in the launcher, then in each rank, so a lone run keeps about one core busy and two runs
side by side use both. The extra worker is for the coordinator tier, which mostly waits: every
other test takes one of the CPU slots, one per core, so at most one busy test per core runs at
once. `-n0` runs in one process (for a debugger, or `-x` on one file).

Cores: an e2e test marked `alone` has a bound that depends on relative speed (the share of
batches a skewed pair's fast rank takes). It holds a lock that keeps every other test from
running beside it; all other tests share that lock. One marked `apart` has a bound in seconds
(a hang detected within 3-8 s, a stop within 10 s): a second lock keeps the other runs (e2e
and coordinator tests) from running beside it, while unit tests, one light process, may.
One marked `waits` mostly sleeps (a stop's grace running out): it takes no CPU slot.

Starting processes: `support._run` forks each CLI run from a per-worker launch server that
has imported torch, Hydra, MLflow and the runner (flodl_run/launch/launchserver.py says what that
changes: nothing the run can see), and `support.start_ranks` forks a test's Gloo ranks from multiprocessing's
forkserver; a fresh interpreter spends about two CPU-seconds importing torch. Tests about an
interpreter's start or about signals to a launcher start `python -m flodl_run` themselves.
`FLODL_TESTS_FRESH=1` makes `_run` start a fresh interpreter every time.

Sharing across workers: a module-scoped fixture would run once per worker that gets one of its
tests, so every test that uses one is put in one xdist group (named after its module) and runs
on one worker. A run several modules need is a session fixture computed once for all workers
(`shared_once`): `solo_eval`, `lockstep_run`.

Helpers (running the CLI, a free port, a small model, the PAIR and LOCKSTEP overrides, the
loopback HOSTS, headless chromium) live in
tests/support.py; test modules import them from there and never from each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from flodl_run.config.schema import SshConfig
from tests.support import HOSTS, LOCKSTEP, _run, free_common_port, kill_leftover_launchers, running_launchers


def pytest_configure(config):
    """Launchers started here must see SIGINT as a terminal's Ctrl-C sends it: a shell that runs
    pytest in the background without job control starts it with SIGINT ignored, an interpreter
    started with SIGINT ignored keeps ignoring it, and the tests that press Ctrl-C on a launcher
    would then watch it train on."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _compile_the_package()


def _compile_the_package() -> None:
    """Byte-compile the repo's packages once, before any worker or run starts. Under
    PYTHONDONTWRITEBYTECODE=1 (set in the environment of the machines it was measured on) no
    interpreter writes the caches, so each of the suite's fresh interpreters (SSH, srun and torchrun ranks,
    submitit jobs, the bench's runs) compiled our modules again: 0.3-0.6 CPU-seconds each,
    measured on `import flodl_run.cli, flodl_run.launch.launcher, flodl_run.rank.process`
    (2.7 CPU-s without the caches, 2.4 with). An editable install has no caches until a run
    writes them; a wheel's install compiles them, as this does."""
    import compileall
    import re

    root = Path(__file__).resolve().parents[1]
    for package in ("flodl_run", "hydra_plugins", "recipes"):
        compileall.compile_dir(root / package, quiet=1)
    # the tests' helpers (support, fakes, the test recipes) too; test modules are pytest's to cache
    compileall.compile_dir(root / "tests", quiet=1, rx=re.compile(r"(^|/)test_[^/]*\.py$"))


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Let pytest keep the test modules it rewrote (their asserts) in tests/__pycache__ even
    under PYTHONDONTWRITEBYTECODE=1: every worker collects the whole suite, and rewrote and
    compiled each of ~100 modules again, every run (`pytest --collect-only`: 9.1 CPU-seconds
    without the cache, 7.1 with it, for each worker). Only while collecting: what the tests
    import later writes nothing, as before."""
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = before


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups to schedule
def pytest_collection_modifyitems(config, items):
    """Every test outside the coordinator and e2e tiers is `unit`; every test that uses a
    module-scoped fixture joins the xdist group of its module. Then the order the workers take
    them in: end-to-end runs first, two side by side, so that the last minutes are quick tests
    rather than one long run, with the coordinator tier spread evenly among them (those tests
    mostly wait out timeouts, and a run beside one has the cores to itself meanwhile; at the
    end, two of them side by side left both cores idle); then the quick tests, with the
    `alone` and `apart` ones spread evenly among them (one worker runs quick tests beside an
    `apart` one; all of them in a row at the end left the other worker with nothing to do)."""
    groups: dict = {}
    for item in items:
        if item.get_closest_marker("coordinator") is None and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.unit)
        defs = getattr(item, "_fixtureinfo", None)
        scopes = [d[-1].scope for d in defs.name2fixturedefs.values()] if defs else []
        if "module" in scopes:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
            groups.setdefault(item.module.__name__, []).append(item)
    group_of = {id(item): members for members in groups.values() for item in members}
    units = [group_of.get(id(item), [item]) for item in items  # a group runs as one unit,
             if group_of.get(id(item), [item])[0] is item]      # in one place in the order
    runs, waits, timed, rest = [], [], [], []
    for unit in units:
        if any(_runs_beside(item) for item in unit):
            runs.append(unit)
        elif any(item.get_closest_marker("coordinator") for item in unit):
            waits.append(unit)
        elif any(item.get_closest_marker("alone") or item.get_closest_marker("apart") for item in unit):
            timed.append(unit)
        else:
            rest.append(unit)
    for units in (runs, timed):  # the longest first (sort is stable: the rest keep their order)
        units.sort(key=lambda unit: -_LONGEST.get(unit[0].module.__name__.rsplit(".", 1)[-1], 0))
    items[:] = [item for unit in _spread(runs, waits) + _spread(rest, timed) for item in unit]


_LONGEST = {"test_bench": 5, "test_sweep": 4, "test_slurm": 4, "test_multi_host": 3,
            "test_torchrun_multinode": 2}
"""Modules whose runs take longest, started first (higher first; the rest keep their order):
their tests start Slurm jobs, submitit jobs, SSH hosts or torchrun agents, each a fresh
interpreter, and took 13-43 s each in a whole-suite run on 2 cores (test_bench's end-to-end
bench 42 s, submitit's requeue 40 s, the Slurm sweep 36 s, a two-host run 27 s). Started last,
one of them kept one worker busy after the other had run out of tests. The `apart` and
`alone` tests go longest first too: the torchrun node loss (13 s, only unit tests beside it),
last in file order, ended a whole-suite run with one core idle."""


def _spread(first: list, second: list) -> list:
    """Both lists in their own order, `second` spread evenly through `first`."""
    placed = [((i + 0.5) / len(first), unit) for i, unit in enumerate(first)]
    placed += [((j + 0.5) / len(second), unit) for j, unit in enumerate(second)]
    return [unit for _, unit in sorted(placed, key=lambda pair: pair[0])]


def _runs_beside(item) -> bool:
    """An end-to-end run that other end-to-end runs may go beside (not `alone` or `apart`)."""
    return item.get_closest_marker("e2e") is not None and item.get_closest_marker("alone") is None \
        and item.get_closest_marker("apart") is None


@pytest.fixture(autouse=True)
def _no_launcher_outlives_its_test():
    """Fixtures of a wider scope are set up before this one: their launchers are spared."""
    before = running_launchers()
    yield
    kill_leftover_launchers(keep=before)


def _invocation_root(tmp_path_factory) -> Path:
    """A folder shared by every worker of this pytest invocation (and by nothing else)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base temps are siblings in one folder per invocation
    return root


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def pytest_xdist_auto_num_workers(config) -> int | None:
    """`-n logical`: one worker per core, and one more for the coordinator tier. Those tests
    mostly wait out timeouts (99 of them: 78 s of wall for 13 CPU-seconds), so on two workers
    a core sat idle while one ran. The CPU slots (`pytest_runtest_protocol`) keep the busy
    tests to one per core. PYTEST_XDIST_AUTO_NUM_WORKERS still decides when set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return _cores() + 1


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of every test under the cores lock: exclusive for `alone`
    tests, shared for the others (so fixtures that start runs are covered too). Unit tests
    share it as well: one beside a run whose bound is relative speed took the fast rank's
    share of a 2.5x-skewed pair from 0.71 to 0.58. Then runs (e2e and coordinator tests) take
    the runs lock, exclusive for `apart` ones, shared otherwise; unit tests leave it alone.
    Last, every test but a coordinator-tier or `waits` one takes one of the CPU slots, one per
    core: a `waits` test spends most of its time asleep (a Ctrl-C's 8 s grace running out on a
    hung rank), and two of them side by side held both slots while both cores idled (13 of a
    whole run's 145 idle core-seconds)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)
    root = _invocation_root(item.config._tmp_path_factory)
    marked = {name for name in ("alone", "apart", "unit", "coordinator", "waits")
              if item.get_closest_marker(name)}
    with contextlib.ExitStack() as held:
        held.enter_context(_held(root, "cores", exclusive="alone" in marked,
                                 gated=root not in _CORES_SHARED))
        if "unit" not in marked:
            held.enter_context(_held(root, "runs", exclusive="apart" in marked))
        if not marked & {"coordinator", "waits"}:
            held.enter_context(_cpu_slot(root))
        return (yield)


_CORES_SHARED: set = set()
"""Invocation roots whose cores lock this worker holds a share of for a module (`cores_held`):
its tests take their share past the gate (an `alone` test waiting at the gate for that module
to end would otherwise wait for the module's next test, which would wait for the gate)."""


@contextlib.contextmanager
def _held(root: Path, name: str, exclusive: bool, gated: bool = True):
    """`<name>.lock` held shared or exclusive, taken through `<name>.gate` so that an
    exclusive taker is not starved: with three workers the shared holders overlap (a worker
    waiting for a CPU slot holds its share meanwhile), and the lock would never come free. An
    exclusive taker holds the gate while it waits; a shared taker passes through it first."""
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    with open(root / f"{name}.gate", "w") as gate, open(root / f"{name}.lock", "w") as lock:
        if gated:
            fcntl.flock(gate, mode)
        fcntl.flock(lock, mode)
        fcntl.flock(gate, fcntl.LOCK_UN)
        yield


@contextlib.contextmanager
def _cpu_slot(root: Path):
    """The first free one of `_cores()` slot locks, polled (flock waits on one file only)."""
    slots = [open(root / f"cpu-slot-{i}.lock", "w") for i in range(_cores())]
    try:
        while not any(_took(slot) for slot in slots):
            time.sleep(0.02)
        yield
    finally:
        for slot in slots:
            slot.close()


def _took(file) -> bool:
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


@pytest.fixture(scope="module")
def cores_held(tmp_path_factory):
    """For a module fixture whose run goes on between its tests (the live dashboard's): a share
    of the cores lock held for the module's life, so no `alone` test runs beside that run while
    the module's worker is between two of its tests."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    root = _invocation_root(tmp_path_factory)
    with _held(root, "cores", exclusive=False, gated=False):  # the test setting it up holds a share
        _CORES_SHARED.add(root)
        try:
            yield
        finally:
            _CORES_SHARED.discard(root)


def shared_once(tmp_path_factory, name: str, produce: Callable[[Path], object]):
    """`produce(folder)` run once per pytest invocation, even across xdist workers: the first
    caller runs it under a file lock and stores its JSON result, later callers read it."""
    root = _invocation_root(tmp_path_factory)
    folder, result = root / f"shared-{name}", root / f"shared-{name}.json"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            folder.mkdir(exist_ok=True)
            result.write_text(json.dumps(produce(folder)))
        return json.loads(result.read_text())


def _solo(folder: Path) -> float:
    solo, summary = _run(folder, "cluster=solo")
    assert solo.returncode == 0, solo.stderr
    return summary["final_eval"]


@pytest.fixture(scope="session")
def solo_eval(tmp_path_factory) -> float:
    """Held-out accuracy of the default recipe trained in-process (the reference of the
    distributed runs' accuracy), one run for the whole suite."""
    return shared_once(tmp_path_factory, "solo_eval", _solo)


def _lockstep(folder: Path) -> dict:
    proc, summary = _run(folder, *LOCKSTEP, "num_epochs=1", env=dict(os.environ, FLODL_RUN_WAITS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"run_dir": str(folder / "run"), "summary": summary}


@pytest.fixture(scope="session")
def lockstep_run(tmp_path_factory) -> dict:
    """One clean epoch of LOCKSTEP (nccl_sync on an equal pair, batch 32) with FLODL_RUN_WAITS=1,
    once for the suite: {"run_dir", "summary"}. Tests read its counts and logs, resume from its
    bundle, or copy the bundle to damage it; none writes into it."""
    return shared_once(tmp_path_factory, "lockstep_run", _lockstep)


@pytest.fixture(scope="session")
def migrated_mlflow_db(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store whose schema is created once per session: the migrations
    cost seconds, so tests that are not about creating a store copy this one (`mlflow_db`).
    Made once for the whole invocation, xdist workers included."""
    return Path(shared_once(tmp_path_factory, "mlflow_template", _migrated_store))


def _migrated_store(folder: Path) -> str:
    import mlflow

    path = folder / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()
    return str(path)


@pytest.fixture
def mlflow_db(migrated_mlflow_db, tmp_path) -> Path:
    """A fresh copy of the migrated store at `<tmp>/store/mlflow.db` (artifacts go beside it)."""
    path = tmp_path / "store" / "mlflow.db"
    path.parent.mkdir()
    shutil.copyfile(migrated_mlflow_db, path)
    return path


# ---- a real sshd for two "hosts" on loopback -------------------------------------------------


def _sshd_binary() -> str | None:
    return shutil.which("sshd") or shutil.which("sshd", path="/usr/sbin:/usr/local/sbin:/sbin")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """sshd on 127.0.0.2 and 127.0.0.3 (one port), accepting one generated key for this user."""
    binary = _sshd_binary()
    if binary is None:
        pytest.skip("sshd is not installed (Debian: apt-get install openssh-server; .ci/run does)")
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("the OpenSSH client (ssh, ssh-keygen) is not installed")
    root = tmp_path_factory.mktemp("sshd")
    if os.geteuid() == 0:
        try:  # sshd refuses to start as root without its privilege-separation directory
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        except OSError as exc:
            pytest.skip(f"cannot create /run/sshd for a root sshd: {exc}")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)],
                       check=True)
    (root / "authorized_keys").write_text((root / "user_key.pub").read_text())
    try:
        port = free_common_port(HOSTS)
    except OSError as exc:
        pytest.skip(f"cannot bind {' and '.join(HOSTS)} here: {exc}")
    listen = "".join(f"ListenAddress {h}\n" for h in HOSTS)
    (root / "sshd_config").write_text(
        f"{listen}Port {port}\nHostKey {root / 'host_key'}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\nPidFile {root / 'sshd.pid'}\n"
        "StrictModes no\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin prohibit-password\n"
        "LogLevel ERROR\n")
    log = open(root / "sshd.log", "w")
    daemon = subprocess.Popen([binary, "-D", "-e", "-f", str(root / "sshd_config")],
                              stdout=log, stderr=subprocess.STDOUT)
    ssh = SshConfig(user=getpass.getuser(), port=port, identity_file=str(root / "user_key"),
                    options=["StrictHostKeyChecking=accept-new",
                             f"UserKnownHostsFile={root / 'known_hosts'}", "LogLevel=ERROR"])
    try:
        _await_login(daemon, ssh, root)
        yield ssh
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)
        log.close()


def _await_login(daemon: subprocess.Popen, ssh: SshConfig, root: Path) -> None:
    """Until a real login works on both addresses (sshd binds asynchronously); else skip."""
    from flodl_run.launch.ssh import ssh_argv

    deadline = time.monotonic() + 15
    while True:
        tries = [subprocess.run(ssh_argv(h, ssh, "true"), capture_output=True, text=True,
                                timeout=20) for h in HOSTS]
        if all(t.returncode == 0 for t in tries):
            return
        if daemon.poll() is not None or time.monotonic() > deadline:
            why = next(t.stderr.strip() for t in tries if t.returncode != 0)
            pytest.skip(f"sshd cannot serve logins here: {why} | sshd: "
                        f"{(root / 'sshd.log').read_text().strip()[-300:]}")
        time.sleep(0.2)
