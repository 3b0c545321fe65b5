"""The fault plan: FLODL_RUN_FAULT parsed once into data, and what a rank fires after a batch."""

from __future__ import annotations

import signal

import pytest

from flodl_run.rank.env import RankEnv
from flodl_run.rank.faults import Fault, FaultPlan, FaultSpecError


def test_a_single_signal_fault_is_parsed_as_the_docs_write_it():
    """Pins the documented form `1:30:SIGKILL`: rank 1, after its 30th batch, SIGKILL."""
    plan = FaultPlan.parse("1:30:SIGKILL")
    assert plan.faults == (Fault(1, 30, "SIGKILL"),)
    assert plan.due(1, 30) == Fault(1, 30, "SIGKILL")
    assert plan.due(1, 29) is None and plan.due(0, 30) is None


def test_several_ranks_each_get_their_own_fault():
    """Pins the comma-separated form the multinode test uses: every rank named gets its own
    fault, a hang included, and a rank not named gets none."""
    plan = FaultPlan.parse("0:8:SIGKILL,1:8:SIGSTOP, 2:5:hang")
    assert [plan.due(r, b) for r, b in ((0, 8), (1, 8), (2, 5))] == list(plan.faults)
    assert plan.due(2, 5).is_hang and not plan.due(1, 8).is_hang
    assert plan.due(3, 8) is None


def test_an_unset_or_empty_spec_is_the_empty_plan():
    """Pins the normal case: no variable (or an empty one) injects nothing."""
    assert FaultPlan.from_environ({}) == FaultPlan()
    assert FaultPlan.from_environ({"FLODL_RUN_FAULT": ""}).faults == ()


@pytest.mark.parametrize("spec", ["1:30", "1:30:SIGKILL:9", "one:30:SIGKILL", "1:x:SIGKILL",
                                  "1:0:SIGKILL", "-1:3:SIGKILL", "1:30:SIGNOPE", "1:30:kill"])
def test_a_malformed_spec_names_the_variable_the_value_and_the_form(spec):
    """Pins the error at the process edge: a wrong field count, a non-number, a batch count the
    rank never checks (0), a negative rank or an unknown action is refused with a message
    naming FLODL_RUN_FAULT, the whole value and the expected form."""
    with pytest.raises(FaultSpecError) as caught:
        FaultPlan.parse(f"0:4:SIGTERM,{spec}")
    message = str(caught.value)
    assert "FLODL_RUN_FAULT" in message and f"0:4:SIGTERM,{spec}" in message
    assert "<rank>:<after batches>:<SIGNAL or hang>" in message


def test_after_batch_hangs_through_the_ranks_callback_and_signals_through_the_os(monkeypatch):
    """Pins the injection point: a due hang calls the rank's hang (nothing else), a due signal
    goes to this process by name, and a batch with nothing due does neither."""
    sent, hung = [], []
    monkeypatch.setattr("flodl_run.rank.faults.os.kill", lambda pid, sig: sent.append(sig))
    plan = FaultPlan.parse("1:3:hang,1:4:SIGSTOP")
    plan.after_batch(1, 2, lambda: hung.append(2))
    plan.after_batch(1, 3, lambda: hung.append(3))
    plan.after_batch(1, 4, lambda: hung.append(4))
    assert hung == [3] and sent == [signal.SIGSTOP]


def _rank_environ(**extra: str) -> dict:
    return dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                FLODL_RUN_COORD="tcp://127.0.0.1:5555", FLODL_RUN_SECRET="ab",
                FLODL_RUN_FILE="run.yaml", **extra)


def test_the_rank_reads_its_fault_plan_once_at_its_process_edge():
    """Pins where parsing happens: RankEnv carries the parsed plan, and a malformed spec stops
    the rank before any setup with the spec's own message (not a traceback mid-setup)."""
    env = RankEnv.from_environ(_rank_environ(FLODL_RUN_FAULT="1:30:SIGKILL"))
    assert env.faults.due(1, 30) == Fault(1, 30, "SIGKILL")
    assert RankEnv.from_environ(_rank_environ()).faults == FaultPlan()
    with pytest.raises(SystemExit, match=r"FLODL_RUN_FAULT='1:30': .*<rank>:<after batches>"):
        RankEnv.from_environ(_rank_environ(FLODL_RUN_FAULT="1:30"))
