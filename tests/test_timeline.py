"""The timeline trace (`timeline=true`): clock alignment as pure logic, the chunked shipment,
and real 2-rank runs whose timeline.json is parsed and checked for consistency."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List

import msgspec
import pytest

from flodl_run.contracts.wire import CONTROL_FRAME_BYTES, ClockPing, TimelineEvents
from flodl_run.observe.timeline import (
    MAX_CHUNK_EVENTS,
    PINGS_AT_START,
    ClockSync,
    RankTimeline,
    Timeline,
    trace_events,
)
from tests.support import _run

REPO = Path(__file__).resolve().parents[1]
TINY = ["cluster=cpu_pair", "recipe=synthetic_mlp", "recipe.params.num_samples=2048",
        "recipe.params.hidden=64", "num_epochs=1", "timeline=true"]


# ---- clock alignment ------------------------------------------------------------------------

def _exchange(sync: ClockSync, t0: int, offset: int, out_ns: int, back_ns: int, hold_ns: int = 1000):
    """One ping sent at rank time t0 over a link taking out_ns there and back_ns back, the
    coordinator (clock = rank clock + offset) holding it hold_ns."""
    t1 = t0 + out_ns + offset
    t2 = t1 + hold_ns
    t3 = t2 - offset + back_ns
    sync.add(t0, t1, t2, t3)


def test_clock_sync_takes_the_lowest_delay_sample_and_bounds_its_error():
    """Pins the NTP estimate: with a known offset, queueing-delayed (asymmetric) samples are
    beaten by the fastest round trip, whose estimate is exact for a symmetric link and within
    the reported uncertainty (half the round trip) for an asymmetric one; an echo whose round
    trip would be negative (not ours) is ignored."""
    offset = 5_000_000_123  # the coordinator's clock is ~5 s ahead, e.g. another host
    sync = ClockSync()
    _exchange(sync, 0, offset, out_ns=40_000, back_ns=3_000_000)     # a reply stuck in a queue
    _exchange(sync, 10**9, offset, out_ns=2_000_000, back_ns=50_000)  # a ping stuck in a queue
    _exchange(sync, 2 * 10**9, offset, out_ns=60_000, back_ns=60_000)  # the quiet one
    sync.add(0, 100, 1_000_100, 500)  # held 1 ms, back after 0.5 ms: a mismatched echo
    estimate = sync.estimate()
    assert estimate.samples == 3
    assert estimate.offset_ns == offset
    assert estimate.uncertainty_ns == 60_000
    skewed = ClockSync()
    _exchange(skewed, 0, -offset, out_ns=10_000, back_ns=90_000)
    got = skewed.estimate()
    assert got.offset_ns != -offset and abs(got.offset_ns - (-offset)) <= got.uncertainty_ns


def test_no_sample_means_no_estimate():
    """Pins the rank's shipment before any echo came back: no offset claimed (uncertainty -1)."""
    assert ClockSync().estimate() is None


# ---- recording and shipment -----------------------------------------------------------------

class _Channel:
    def __init__(self):
        self.sent = []

    def send(self, message, payloads=(), identity=None):
        self.sent.append(message)

    def recv(self, timeout_ms=None):
        return None  # no coordinator: clock pings go unanswered


def test_shipment_is_chunked_below_the_frame_limit_and_final_marks_the_last():
    """Pins the control plane's frame limit: a backlog larger than one chunk leaves in chunks of
    at most MAX_CHUNK_EVENTS that encode well below CONTROL_FRAME_BYTES, nothing is lost or
    repeated, and only the last shipment at Stop is final."""
    timeline = RankTimeline(1, on=True, label="host cpu")
    total = 2 * MAX_CHUNK_EVENTS + 7
    for i in range(total):
        began = timeline.recorder.now()
        timeline.recorder.batch(began, began + 1, i)
    channel = _Channel()
    timeline.ship(channel)
    timeline.recorder.instant("window_end", 3)
    timeline.ship(channel, final=True)
    chunks = [m for m in channel.sent if isinstance(m, TimelineEvents)]
    assert [len(c.events) for c in chunks] == [MAX_CHUNK_EVENTS] * 4 + [14, 1]
    assert [c.final for c in chunks] == [False] * 5 + [True]
    numbers = [e[4] for c in chunks for e in c.events if e[1] == "step"]
    assert numbers == list(range(total))
    assert all(len(msgspec.msgpack.encode(c)) < CONTROL_FRAME_BYTES // 4 for c in chunks)
    assert chunks[0].uncertainty_ns == -1  # no clock sample was taken


def test_off_records_nothing_and_ships_nothing():
    """Pins the off switch: the recorder's hooks are no-ops and no message goes out."""
    timeline = RankTimeline(0, on=False)
    timeline.recorder.batch(timeline.recorder.now(), 0, 0)
    timeline.recorder.instant("window_end", 1)
    channel = _Channel()
    timeline.on_beat(channel)
    timeline.ship(channel, final=True)
    assert channel.sent == [] and not hasattr(timeline.recorder, "events")


class _Loopback:
    """A rank's heartbeat channel wired to a coordinator's Timeline (answers in-process)."""

    def __init__(self, coordinator: Timeline):
        self.coordinator, self.sent, self.inbox = coordinator, [], []

    def send(self, message, payloads=(), identity=None):
        if identity is not None:  # the coordinator's answer
            self.inbox.append(SimpleNamespace(message=message))
            return
        self.sent.append(message)
        if isinstance(message, ClockPing):
            self.coordinator.receive(message, b"rank", self)

    def recv(self, timeout_ms=None):
        return self.inbox.pop(0) if self.inbox else None


def test_deadline_windows_measure_the_clock_with_the_timeline_off():
    """Pins the online offset a deadline window needs: with the timeline off on both sides,
    a rank that aligns (elche.window_end=deadline) still pings on its beats and the
    coordinator still answers, so the rank has an estimate (near 0 in one process), and no
    event is shipped; without deadline windows nothing is sent at all."""
    channel = _Loopback(Timeline())
    aligned = RankTimeline(0, on=False, aligns=True)
    aligned.on_beat(channel)
    aligned.on_beat(channel)
    assert [type(m) for m in channel.sent] == [ClockPing] * (PINGS_AT_START + 1)
    estimate = aligned.clock.estimate()
    assert estimate.samples == PINGS_AT_START + 1
    assert abs(estimate.offset_ns) <= estimate.uncertainty_ns
    quiet = _Loopback(Timeline())
    RankTimeline(0, on=False).on_beat(quiet)
    assert quiet.sent == []


def test_trace_events_apply_each_tracks_offset():
    """Pins the alignment in the file: a rank's event lands at its time plus its offset, in
    microseconds since the origin; each track is named by process_name metadata."""
    events = trace_events([(0, "coordinator", [("i", "checkpoint", 2_000_000, 0, "saved")], 0),
                           (2, "rank 1", [("X", "step", 1_000_000, 500_000, 7),
                                          ("C", "cpu %", 1_000_000, 0, 97.5)], 1_500_000)],
                          origin_ns=1_000_000)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "coordinator", 2: "rank 1"}
    step = next(e for e in events if e["name"] == "step")
    assert (step["ts"], step["dur"], step["args"]) == (1500.0, 500.0, {"batch": 7})
    counter = next(e for e in events if e["ph"] == "C")
    assert counter["args"] == {"cpu %": 97.5} and counter["ts"] == 1500.0
    mark = next(e for e in events if e["name"] == "checkpoint")
    assert mark["ph"] == "i" and mark["ts"] == 1000.0 and mark["args"] == {"message": "saved"}


# ---- real runs ------------------------------------------------------------------------------

def _traced(tmp_path: Path, *overrides: str, tracking: str = "off") -> dict:
    proc, _ = _run(tmp_path, *TINY, *overrides, tracking=tracking, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp_path / "run" / "timeline.json").read_text())


def _spans(trace: dict) -> Dict[int, List[dict]]:
    by_pid = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_pid[e["pid"]].append(e)
    return by_pid


def _check_tracks(trace: dict) -> None:
    """Metadata for the coordinator and both ranks, clock offsets with an uncertainty, every
    rank's last shipment in, batches on every rank that never overlap, a window_end instant."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names[0] == "coordinator" and names[1].startswith("rank 0") and names[2].startswith("rank 1")
    clocks = trace["otherData"]["clock_offsets"]
    assert set(clocks) == {"rank 0", "rank 1"}
    for clock in clocks.values():
        assert clock["complete"] and clock["uncertainty_ns"] is not None
        # same host, same monotonic clock: the true offset is 0, so the estimate is within its bound
        assert abs(clock["offset_ns"]) <= clock["uncertainty_ns"]
    spans = _spans(trace)
    for pid in (1, 2):
        batches = sorted((e for e in spans[pid] if e["name"] in ("data", "step")), key=lambda e: e["ts"])
        assert len(batches) >= 10
        for before, after in zip(batches, batches[1:]):
            assert before["ts"] + before["dur"] <= after["ts"] + 1e-3, (before, after)
        on_track = sorted(spans[pid], key=lambda e: e["ts"])  # one thread: nothing overlaps
        for before, after in zip(on_track, on_track[1:]):
            assert before["ts"] + before["dur"] <= after["ts"] + 1e-3, (before, after)
        ends = [e for e in trace["traceEvents"] if e["pid"] == pid and e["name"] == "window_end"]
        assert ends and all(e["ph"] == "i" for e in ends)


def _tolerance_us(trace: dict) -> float:
    """The clocks' worst claimed error plus 1 ms of slack for the recording's own timestamps."""
    worst = max(c["uncertainty_ns"] for c in trace["otherData"]["clock_offsets"].values())
    return worst / 1000.0 + 1000.0


@pytest.mark.e2e
def test_cpu_cadence_trace_orders_every_round_coordinator_between_ranks(tmp_path, mlflow_db):
    """Pins the coordinator backend's round in aligned time: for every round, each rank's
    snapshot begins before the coordinator averages and its apply begins after the average
    ended (the update cannot arrive earlier), within the clocks' uncertainty; plus the
    per-track checks, and the trace attached to the MLflow run."""
    trace = _traced(tmp_path, "elche=cpu_cadence", f"tracking.uri=sqlite:///{mlflow_db}",
                    tracking="mlflow")
    _check_tracks(trace)
    spans, slack = _spans(trace), _tolerance_us(trace)
    averages = {e["args"]["round"]: e for e in spans[0] if e["name"] == "reduce.average"}
    assert len(averages) >= 2
    for pid in (1, 2):
        snapshots = {e["args"]["round"]: e for e in spans[pid] if e["name"] == "reduce.snapshot"}
        applies = {e["args"]["round"]: e for e in spans[pid] if e["name"] == "reduce.apply"}
        assert set(snapshots) == set(applies) == set(averages)
        for round_, average in averages.items():
            assert snapshots[round_]["ts"] <= average["ts"] + slack
            assert applies[round_]["ts"] >= average["ts"] + average["dur"] - slack
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{mlflow_db}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    assert "timeline.json" in {a.path for a in client.list_artifacts(run.info.run_id)}


@pytest.mark.e2e
def test_nccl_cadence_reduce_spans_share_rounds_and_overlap(tmp_path):
    """Pins the collective round in aligned time: both ranks record the same round ids; each
    round's averaging spans (the parameters' all-reduce, which cannot end on one rank before
    the other joined it) overlap across the ranks, and neither rank's wait for its peers ends
    before the other's began, within the clocks' uncertainty; plus the per-track checks."""
    trace = _traced(tmp_path, "elche=nccl_cadence")
    _check_tracks(trace)
    spans, slack = _spans(trace), _tolerance_us(trace)
    per_rank = [{e["args"]["round"]: e for e in spans[pid] if e["name"] == "reduce.average"}
                for pid in (1, 2)]
    assert per_rank[0] and set(per_rank[0]) == set(per_rank[1])
    for round_ in per_rank[0]:
        a, b = per_rank[0][round_], per_rank[1][round_]
        assert max(a["ts"], b["ts"]) <= min(a["ts"] + a["dur"], b["ts"] + b["dur"]) + slack
        waits = [[e for e in spans[pid] if e["name"] == "reduce.wait" and e["args"]["round"] == round_]
                 for pid in (1, 2)]
        assert [len(w) for w in waits] == [1, 1]
        first, second = waits[0][0], waits[1][0]  # neither is released before the other arrived
        assert first["ts"] + first["dur"] >= second["ts"] - slack
        assert second["ts"] + second["dur"] >= first["ts"] - slack


def test_clock_ping_has_a_place_on_the_wire():
    """Pins the direction of the clock messages: a ClockPing is a rank's fact, so the
    coordinator's channel decodes it (a typo in FACTS/ORDERS would drop every ping)."""
    from flodl_run.contracts.wire import FACTS, ORDERS, ClockEcho

    assert ClockPing in FACTS and TimelineEvents in FACTS and ClockEcho in ORDERS


# ---- the bench's measurement of the overhead -------------------------------------------------

@pytest.mark.e2e
def test_bench_runs_a_mode_again_with_the_timeline_and_reports_its_cost(tmp_path):
    """Pins the overhead entry of the bench: `bench.timeline=[mode]` adds `<mode>+timeline`
    (the same run plus timeline=true), whose ratio is its samples/s over the plain entry's, and
    whose recording share is the trace's per-batch recording time over its mean batch time
    (positive, and small for millisecond batches); other entries carry neither."""
    from flodl_run.bench.report import RecipeBench, RunOutcome, bench_document
    from flodl_run.config.schema import Mode
    from tests.support import _summary, cadence_bench_jobs

    jobs = cadence_bench_jobs(timeline=[Mode.nccl_cadence])
    assert [j.name for j in jobs] == ["nccl_cadence", "nccl_cadence+timeline"]
    assert "timeline=true" in jobs[1].overrides and "timeline=true" not in jobs[0].overrides
    assert "elche=nccl_cadence" in jobs[1].overrides
    trace = {"traceEvents": [{"ph": "X", "name": n, "pid": 1, "tid": 0, "ts": 10.0 * i, "dur": d}
                             for i in range(100) for n, d in (("data", 100.0), ("step", 900.0))]}
    (tmp_path / "timeline.json").write_text(json.dumps(trace))
    outcomes = [RunOutcome(j.name, j.recipe, j.kind, j.mode, j.outer, 10.0,
                           _summary([0.5], samples_per_s=rate), str(tmp_path), "cmd")
                for j, rate in zip(jobs, (100.0, 99.0))]
    plain, traced = bench_document([RecipeBench(jobs[0].recipe, None, [1.0, 2.5])], outcomes, {})["entries"]
    assert plain["ratio_to_timeline_off"] is None and plain["timeline_record_share"] is None
    assert traced["ratio_to_timeline_off"] == pytest.approx(0.99)  # 99 samples/s over 100
    assert 0.0 < traced["timeline_record_share"] < 0.01  # a few microseconds of a 1 ms batch


def test_a_dead_ranks_shipped_events_stay_in_the_trace(tmp_path):
    """Pins what a rank death keeps: the coordinator's file holds every event a rank shipped
    before it died, marked incomplete (no final shipment), next to a survivor's complete track;
    a ClockPing is answered with the ping's own send time."""
    from flodl_run.contracts.wire import ClockEcho
    from flodl_run.observe.timeline import TimelineFile

    timeline = TimelineFile(tmp_path / "timeline.json")
    channel = _Channel()
    timeline.receive(ClockPing(1, 42), b"id", channel)
    assert isinstance(channel.sent[0], ClockEcho) and channel.sent[0].sent_ns == 42
    timeline.receive(TimelineEvents(0, [("X", "step", 5, 1, 0)], 0, 10, "h cpu", final=True), None, channel)
    timeline.receive(TimelineEvents(1, [("X", "step", 5, 1, 0), ("i", "window_end", 6, 0, 1)],
                                    -3, 20, "h cpu"), None, channel)
    trace = timeline.trace()
    timeline._stopped.set()
    clocks = trace["otherData"]["clock_offsets"]
    assert clocks["rank 0"]["complete"] and not clocks["rank 1"]["complete"]
    assert clocks["rank 1"] == {"offset_ns": -3, "uncertainty_ns": 20, "complete": False}
    dead = [e["name"] for e in trace["traceEvents"] if e["pid"] == 2 and e["ph"] != "M"]
    assert dead == ["step", "window_end"]
