"""The timeline trace (`timeline=true`): spans, instants and counters from the coordinator and
every rank, written as one Chrome trace-event file (`timeline.json`, opens in Perfetto).

Owns the in-memory recorder each process appends to (tuples on a deque: no I/O, no device
sync, no dict per event), the rank side's shipping of its events to the coordinator over the
control plane (from the heartbeat thread, in bounded chunks), the clock alignment (NTP-style
round trips, the lowest-delay sample wins) and the trace file. It decides nothing about the run.
Everything is a no-op when the timeline is off.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Deque, Dict, List, Optional, Tuple

from flodl_run.contracts.clock import RECENT_SAMPLES, ClockSync
from flodl_run.contracts.summary import EpochRecord, ReduceRecord, Summary
from flodl_run.contracts.wire import ClockEcho, ClockPing, TimelineEvents
from flodl_run.observe.observer import Observer

Event = Tuple[str, str, int, int, Any]
"""(phase, name, start ns, duration ns, argument): phase "X" a span, "i" an instant, "C" a
counter (the argument is its value). Times are the recording process's perf_counter_ns."""

MAX_CHUNK_EVENTS = 20_000
"""Events per TimelineEvents message: ~25 bytes each packed, so a chunk stays near 0.5 MB, far
below the control plane's smallest frame limit (4 MB) even with longer instant messages."""
FINAL_WAIT_S = 2.0
"""How long the coordinator waits at the end for each rank's last shipment."""
PINGS_AT_START = 8
ECHO_WAIT_MS = 200
SAMPLE_PERIOD_S = 0.5  # the coordinator's own counters; ranks sample once per heartbeat
COORDINATOR_PID = 0
FILE_NAME = "timeline.json"

ARG_NAMES = {"data": "batch", "step": "batch", "window_end": "window", "eval": "epoch",
             "checkpoint": "epoch", "regroup": "generation", "wait": "order", "throttled": "order",
             "deadline": "window"}
"""The argument's name in the trace per event name (reduce phases carry the round, other
text is a message)."""


# ---- recording ----------------------------------------------------------------------------

class Recorder:
    """The no-op recorder (timeline off): every hook returns at once."""

    on = False

    def now(self) -> int:
        return 0

    def span(self, name: str, began_ns: int, arg: Any = -1) -> None:
        """A span from `began_ns` (a `now()`) to now."""

    def span_between(self, name: str, began_ns: int, ended_ns: int, arg: Any = -1) -> None:
        """A span between two `now()` readings."""

    def batch(self, began_ns: int, data_ns: int, number: int) -> None:
        """One batch: its data wait [began, data) and its step [data, now)."""

    def instant(self, name: str, arg: Any = -1) -> None:
        """Something that happened now."""

    def counter(self, name: str, value: float) -> None:
        """A sampled value, now."""

    def lap(self) -> None:
        """Note the time a phase inside a call ended (read back by `last_lap`)."""

    def last_lap(self, began_ns: int) -> int:
        return began_ns


class Recording(Recorder):
    """Appends event tuples to a deque (its append and popleft are atomic, so another thread
    may drain it while this one records)."""

    on = True

    def __init__(self) -> None:
        self.events: Deque[Event] = deque()
        self._lap = 0

    def now(self) -> int:
        return time.perf_counter_ns()

    def span(self, name: str, began_ns: int, arg: Any = -1) -> None:
        self.events.append(("X", name, began_ns, time.perf_counter_ns() - began_ns, arg))

    def span_between(self, name: str, began_ns: int, ended_ns: int, arg: Any = -1) -> None:
        self.events.append(("X", name, began_ns, ended_ns - began_ns, arg))

    def batch(self, began_ns: int, data_ns: int, number: int) -> None:
        ended = time.perf_counter_ns()
        self.events.append(("X", "data", began_ns, data_ns - began_ns, number))
        self.events.append(("X", "step", data_ns, ended - data_ns, number))

    def instant(self, name: str, arg: Any = -1) -> None:
        self.events.append(("i", name, time.perf_counter_ns(), 0, arg))

    def counter(self, name: str, value: float) -> None:
        self.events.append(("C", name, time.perf_counter_ns(), 0, value))

    def lap(self) -> None:
        self._lap = time.perf_counter_ns()

    def last_lap(self, began_ns: int) -> int:
        return self._lap if self._lap >= began_ns else began_ns

    def drain(self, limit: int) -> List[Event]:
        """Up to `limit` of the oldest events, removed (safe against another thread draining:
        the heartbeat's shipment and the one at Stop may overlap)."""
        out: List[Event] = []
        try:
            for _ in range(min(limit, len(self.events))):
                out.append(self.events.popleft())
        except IndexError:
            pass
        return out


class Sampler:
    """Counters of this process: CPU use (all its threads, % of one core) and, on a CUDA
    device, the GPU's utilization and memory from NVML. No NVML, no GPU counters: never an
    error."""

    def __init__(self, cuda_index: Optional[int] = None):
        self._cpu = (time.process_time_ns(), time.perf_counter_ns())
        self._gpu = _nvml_handle(cuda_index) if cuda_index is not None else None

    def sample(self, recorder: Recorder) -> None:
        cpu, wall = time.process_time_ns(), time.perf_counter_ns()
        if wall > self._cpu[1]:
            recorder.counter("cpu %", round(100.0 * (cpu - self._cpu[0]) / (wall - self._cpu[1]), 1))
        self._cpu = (cpu, wall)
        if self._gpu is None:
            return
        try:
            import pynvml

            util = pynvml.nvmlDeviceGetUtilizationRates(self._gpu)
            memory = pynvml.nvmlDeviceGetMemoryInfo(self._gpu)
        except Exception:  # the driver went away: stop asking
            self._gpu = None
            return
        recorder.counter("gpu util %", float(util.gpu))
        recorder.counter("gpu memory MiB", round(memory.used / 2**20, 1))


def _nvml_handle(cuda_index: int) -> Optional[Any]:
    """The NVML handle of CUDA device `cuda_index` of this process (CUDA_VISIBLE_DEVICES
    honoured), or None without NVML or such a device."""
    try:
        import pynvml

        from flodl_run.hardware.devices import visible_gpus

        gpus = visible_gpus()
        if cuda_index >= len(gpus):
            return None
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByUUID(gpus[cuda_index].uuid)
    except Exception:
        return None


# ---- the rank side ------------------------------------------------------------------------

class RankTimeline:
    """A rank's recorder plus what its heartbeat thread does each beat: measure the clock
    against the coordinator's, sample the counters, and ship what was recorded. Off, it only
    hands out the no-op recorder, and measures the clock only when `aligns` (deadline windows
    need the offset whether or not there is a timeline)."""

    def __init__(self, rank: int, on: bool, label: str = "", cuda_index: Optional[int] = None,
                 aligns: bool = False):
        self.rank, self.label = rank, label
        self.recorder: Recorder = Recording() if on else Recorder()
        self.clock = ClockSync(recent=RECENT_SAMPLES)
        self.aligns = on or aligns
        self._sampler = Sampler(cuda_index) if on else None
        self._beats = 0
        self._shipping = threading.Lock()  # a chunk drained is sent before the final one

    def on_beat(self, channel: Any) -> None:
        """Heartbeat thread, its own socket: clock round trips (a few on the first beat),
        counters, then the events recorded so far. A rank that dies later keeps these. A
        failure here is printed once and ends the timeline and the clock's round trips, never
        the heartbeat."""
        if not self.aligns:
            return
        try:
            for _ in range(PINGS_AT_START if self._beats == 0 else 1):
                if not self._ping(channel):
                    break
            self._beats += 1
            if self._sampler is not None:
                self._sampler.sample(self.recorder)
                self.ship(channel)
        except Exception as exc:
            self._sampler, self.aligns = None, False
            print(f"rank {self.rank}: timeline and clock off: {type(exc).__name__}: {exc}",
                  file=sys.stderr)

    def _ping(self, channel: Any) -> bool:
        """One round trip; False when no echo came back within ECHO_WAIT_MS (a late one is
        still taken next time: its long round trip cannot win)."""
        sent = time.perf_counter_ns()
        channel.send(ClockPing(self.rank, sent))
        while True:
            received = channel.recv(timeout_ms=ECHO_WAIT_MS)
            if received is None:
                return False
            echo = received.message
            if isinstance(echo, ClockEcho):
                self.clock.add(echo.sent_ns, echo.received_ns, echo.replied_ns, time.perf_counter_ns())
                if echo.sent_ns == sent:
                    return True

    def ship(self, channel: Any, final: bool = False) -> None:
        """Send the recorded events in chunks of at most MAX_CHUNK_EVENTS, with the clock
        estimate; `final` (at Stop) marks the last, after a few more clock round trips (the
        coordinator is idle then: the quietest samples of the run)."""
        if not self.recorder.on:
            return
        for _ in range(PINGS_AT_START if final else 0):
            if not self._ping(channel):
                break
        estimate = self.clock.estimate()
        offset, error = (estimate.offset_ns, estimate.uncertainty_ns) if estimate else (0, -1)
        with self._shipping:
            while True:
                events = self.recorder.drain(MAX_CHUNK_EVENTS)
                last = len(self.recorder.events) == 0
                if events or (final and last):
                    channel.send(TimelineEvents(self.rank, events, offset, error, self.label,
                                                final=final and last))
                if last:
                    return

    def order_span(self, order: Any, began_ns: int) -> None:
        """The span of an order the rank just served, for those worth one."""
        name = ORDER_SPANS.get(type(order).__name__)
        if name is not None:
            arg = getattr(order, "round", None)
            if arg is None:
                arg = getattr(order, "epoch", getattr(order, "generation", -1))
            self.recorder.span(name, began_ns, -1 if arg is None else arg)


ORDER_SPANS = {"Update": "reduce.apply", "Evaluate": "eval", "SaveCheckpoint": "checkpoint",
               "Regroup": "regroup"}


# ---- the coordinator side and the file ----------------------------------------------------

class Timeline:
    """The coordinator's view when the timeline is off: nothing recorded, nothing awaited."""

    recorder: Recorder = Recorder()

    def receive(self, message: Any, identity: Optional[bytes], channel: Any) -> None:
        """A ClockPing (answered at once, the timeline on or off: a deadline window's instant
        needs the ranks' clock offsets) or a TimelineEvents shipment (dropped)."""
        if isinstance(message, ClockPing):
            received = time.perf_counter_ns()
            channel.send(ClockEcho(message.sent_ns, received, time.perf_counter_ns()), identity=identity)

    def await_final(self, channel: Any, ranks: List[int]) -> None:
        """At the end: take the ranks' last shipments (they were just sent Stop)."""


@dataclass
class _RankTrack:
    label: str = ""
    events: List[Event] = field(default_factory=list)
    offset_ns: int = 0
    uncertainty_ns: int = -1
    final: bool = False


class TimelineFile(Timeline, Observer):
    """The coordinator's recorder, the ranks' shipments, and the observer hooks that become
    instants (events, anchor and phase changes) on the coordinator's track. `finish` writes
    `timeline.json` into the run dir."""

    output = "the timeline"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.recorder = Recording()
        self.origin_ns = time.perf_counter_ns()
        self.ranks: Dict[int, _RankTrack] = {}
        self._stopped = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="timeline-sampler", daemon=True)
        self._sampler.start()

    @classmethod
    def for_run(cls, enabled: bool, run_dir: Path) -> Optional["TimelineFile"]:
        """The run's timeline, or None when it is off (the `timeline` key)."""
        return cls(Path(run_dir) / FILE_NAME) if enabled else None

    def _sample(self) -> None:
        sampler = Sampler()
        while not self._stopped.wait(SAMPLE_PERIOD_S):
            sampler.sample(self.recorder)

    # ---- from the control plane (the coordinator's thread) ------------------------------

    def receive(self, message: Any, identity: Optional[bytes], channel: Any) -> None:
        if isinstance(message, ClockPing):
            super().receive(message, identity, channel)
            return
        track = self.ranks.setdefault(message.rank, _RankTrack())
        track.events.extend(message.events)
        track.label = message.label or track.label
        if message.uncertainty_ns >= 0:
            track.offset_ns, track.uncertainty_ns = message.offset_ns, message.uncertainty_ns
        track.final = track.final or message.final

    def await_final(self, channel: Any, ranks: List[int]) -> None:
        """Until every rank's final shipment is in (FINAL_WAIT_S at most), then while more
        keeps coming: a heartbeat's last chunk travels on another socket and may land after."""
        deadline = time.monotonic() + FINAL_WAIT_S
        waiting = set(ranks)
        while time.monotonic() < deadline:
            received = channel.recv(timeout_ms=50 if waiting else 20)
            if received is None and not waiting:
                return
            if received is not None and isinstance(received.message, (ClockPing, TimelineEvents)):
                self.receive(received.message, received.identity, channel)
                if isinstance(received.message, TimelineEvents) and received.message.final:
                    waiting.discard(received.message.rank)

    # ---- observer hooks -----------------------------------------------------------------

    def on_event(self, kind: str, message: str) -> None:
        self.recorder.instant(kind, message)

    def on_reduce(self, record: ReduceRecord) -> None:
        """The anchor as a counter (its changes, and the phase's, come as ElChe's events)."""
        self.recorder.counter("anchor", float(record.anchor))

    def on_epoch(self, record: EpochRecord) -> None:
        self.recorder.instant("epoch_end", f"epoch {record.epoch + 1}: loss {record.avg_loss:.4g}"
                                           + ("" if record.eval is None else f", eval {record.eval:.4g}"))

    # ---- the file -----------------------------------------------------------------------

    def finish(self, summary: Summary, run_dir: Path) -> None:
        """Write the trace (what every rank shipped, aligned to the coordinator's clock)."""
        self._stopped.set()
        self.path.write_text(json.dumps(self.trace(summary)))

    def trace(self, summary: Optional[Summary] = None) -> Dict[str, Any]:
        """The trace-event document: every track's events, each rank's clock offset and its
        bound under `otherData.clock_offsets`, and the run's mode, world size and status."""
        own = list(self.recorder.events)
        tracks = [(COORDINATOR_PID, "coordinator", own, 0)]
        clocks = {}
        for rank in sorted(self.ranks):
            track = self.ranks[rank]
            tracks.append((rank + 1, f"rank {rank}" + (f" ({track.label})" if track.label else ""),
                           track.events, track.offset_ns))
            clocks[f"rank {rank}"] = {
                "offset_ns": track.offset_ns,
                "uncertainty_ns": None if track.uncertainty_ns < 0 else track.uncertainty_ns,
                "complete": track.final}
        events = trace_events(tracks, self.origin_ns)
        other = {"clock": "perf_counter_ns of each process, aligned to the coordinator's by "
                          "control-plane round trips (offset = coordinator - rank)",
                 "clock_offsets": clocks}
        if summary is not None:
            other.update(mode=summary.mode, world_size=summary.world_size, status=summary.status)
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def trace_events(tracks: List[Tuple[int, str, List[Event], int]], origin_ns: int) -> List[dict]:
    """Chrome trace events: per track (pid, name, events, clock offset) its process_name
    metadata and its events, timestamps in microseconds since `origin_ns` on the coordinator's
    clock."""
    out: List[dict] = []
    for pid, name, events, offset in tracks:
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": pid}})
        for phase, ev_name, start, dur, arg in events:
            ts = (start + offset - origin_ns) / 1000.0
            if phase == "C":
                out.append({"ph": "C", "name": ev_name, "pid": pid, "tid": 0, "ts": ts,
                            "args": {ev_name: arg}})
                continue
            key = "round" if ev_name.startswith("reduce") else ARG_NAMES.get(ev_name, "value")
            if isinstance(arg, str) and key != "order":
                key = "message"
            event = {"ph": phase, "name": ev_name, "pid": pid, "tid": 0, "ts": ts,
                     "args": {} if arg == -1 else {key: arg}}
            if phase == "X":
                event["dur"] = dur / 1000.0
            else:
                event["s"] = "g" if ev_name == "rank_lost" else "p"
            out.append(event)
    return out


# ---- the recording's own cost -------------------------------------------------------------

def recording_share(path: Path, calls: int = 100_000) -> Optional[float]:
    """What recording costs the ranks, as a share of their batch time, for the trace at
    `path`: the ranks' events per batch at the cost of one append measured here (`calls`
    times), the per-batch clock reads and appends measured as the rank makes them, over the
    trace's mean batch time (data + step). None without a trace or batches. Shipping (the
    heartbeat thread's encoding) is not in it: the bench's on/off ratio covers that."""
    try:
        trace = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    ranks = [e for e in trace["traceEvents"] if e["ph"] != "M" and e["pid"] != COORDINATOR_PID]
    batch_us = [e["dur"] for e in ranks if e["ph"] == "X" and e["name"] in ("data", "step")]
    batches = sum(1 for e in ranks if e["ph"] == "X" and e["name"] == "step")
    if not batches:
        return None
    per_batch_ns, per_event_ns = _hot_path_ns(calls)
    extra = max(0, len(ranks) - 2 * batches)  # reduce phases, waits, instants, counters
    cost_ns = per_batch_ns + extra / batches * per_event_ns
    return cost_ns / (sum(batch_us) / batches * 1000.0)


def _hot_path_ns(calls: int) -> Tuple[float, float]:
    """(ns per batch as the rank records it: two clock reads and `batch`, ns per other span)."""
    recorder = Recording()
    began = time.perf_counter_ns()
    for i in range(calls):
        start = recorder.now()
        data = recorder.now()
        recorder.batch(start, data, i)
    per_batch = (time.perf_counter_ns() - began) / calls
    recorder.events.clear()
    began = time.perf_counter_ns()
    for i in range(calls):
        recorder.span("reduce.apply", began, i)
    return per_batch, (time.perf_counter_ns() - began) / calls
