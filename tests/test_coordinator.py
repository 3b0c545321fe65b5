"""The coordinator's window loop against scripted ranks (tests/fakes.py: threads speaking the
real wire format). Faults and speeds are data: each fake rank reports `ms_per_batch` of compute
per batch."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import List

import pytest
import zmq

from flodl_run.config.schema import ElCheConfig, ExperimentConfig, SyncAverage
from flodl_run.contracts.checkpoint import read_meta, save_meta
from flodl_run.contracts.wire import Channel, Heartbeat, new_secret
from flodl_run.control.coordinator import Coordinator
from flodl_run.observe.observer import Observer
from tests.fakes import NUM_SAMPLES, FakeRank, drive
from tests.support import pooled_share


def _run(mode: str, ms: List[float], epochs: int = 2, batch_size: int = 8, observer=None, **run):
    elche = run.pop("elche", None) or ElCheConfig.preset(mode)
    config = ExperimentConfig(elche=elche, num_epochs=epochs, batch_size=batch_size, **run)
    secret = new_secret()
    coord = Coordinator(config, len(ms), secret, observer=observer)
    ranks = [FakeRank(r, len(ms), coord.address, secret, m, batch_size, mode) for r, m in enumerate(ms)]
    return drive(coord, ranks)


def _floDl(mode: str) -> ElCheConfig:
    """The mode's preset, nccl_sync as floDl's parameter-averaging variant."""
    return replace(ElCheConfig.preset(mode), sync_average=SyncAverage.params)


def _positions(ranks, epochs):
    seen = Counter()
    for r in ranks:
        for pass_index, offset, size in r.slices:
            for pos in range(offset, offset + size):
                seen[(pass_index, pos)] += 1
    return seen


@pytest.mark.coordinator
@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence", "cpu_async"])
def test_progressive_modes_cover_every_sample_once_and_favour_the_fast_rank(mode):
    """Pins progressive dispatch: each sample of each epoch trained exactly once (async too,
    across epoch boundaries), and a rank 2.5x faster takes the larger batch share once the
    balancer has its first epoch's timings. The share is pooled over the later epochs: cpu_async's
    whole chunks move batches between epochs (0.75 then 0.625 of the fast rank's, or 0.625 twice,
    on a loaded 2-core machine), the cadence modes' 0.71 each."""
    summary, ranks = _run(mode, [4.0, 10.0], epochs=3)
    assert summary.status == "completed", summary.message
    seen = _positions(ranks, 3)
    assert set(seen.values()) == {1}
    assert len(seen) == 3 * NUM_SAMPLES
    assert pooled_share(summary.epochs[1:]) > 0.6, [e.per_rank_batch_share for e in summary.epochs]


@pytest.mark.coordinator
@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence"])
def test_cadence_without_progressive_dispatch_keeps_fixed_shares(mode):
    """Pins progressive_dispatch=false in the cadence modes: each rank's share of the epoch is
    fixed up front (equal), so a rank 2.5x faster still trains half of it (and idles once its
    share runs out), and every sample is trained exactly once."""
    summary, ranks = _run(mode, [4.0, 10.0], epochs=2, progressive_dispatch=False)
    assert summary.status == "completed", summary.message
    assert set(_positions(ranks, 2).values()) == {1} and len(_positions(ranks, 2)) == 2 * NUM_SAMPLES
    assert summary.epochs[-1].per_rank_batch_share == [0.5, 0.5]


@pytest.mark.coordinator
@pytest.mark.parametrize("mode", ["nccl_sync", "cpu_sync"])
def test_sync_modes_shard_the_epoch_by_partition_ratios(mode):
    """Pins that the sync modes split each epoch by the stated partition_ratios (3:1 here, on
    ranks of equal speed), not equally: rank 0 trains three quarters of every epoch."""
    elche = replace(ElCheConfig.preset(mode), partition_ratios=[3.0, 1.0])
    summary, ranks = _run(mode, [5.0, 5.0], epochs=1, elche=elche)
    assert summary.status == "completed", summary.message
    assert set(_positions(ranks, 1).values()) == {1}
    assert summary.epochs[-1].per_rank_batch_share == [0.75, 0.25]


@pytest.mark.coordinator
@pytest.mark.parametrize("mode", ["nccl_sync", "cpu_sync"])
def test_sync_with_progressive_dispatch_lets_the_fast_rank_take_more(mode):
    """Pins progressive_dispatch=true in a sync mode: ranks take their next batch from the whole
    epoch, not from a fixed equal share, so the rank 10x faster trains more than half of it;
    every sample still exactly once. (The gap is wide so that the per-batch work every rank pays
    on top of its sleep, about 8 ms a batch on a loaded 2-core CI box, cannot close it: with
    4 vs 10 ms that box saw 0.59.)"""
    summary, ranks = _run(mode, [2.0, 20.0], epochs=1, progressive_dispatch=True)
    assert summary.status == "completed", summary.message
    assert set(_positions(ranks, 1).values()) == {1} and len(_positions(ranks, 1)) == NUM_SAMPLES
    assert summary.epochs[-1].per_rank_batch_share[0] > 0.6


@pytest.mark.coordinator
@pytest.mark.parametrize("mode", ["nccl_sync", "cpu_sync"])
def test_sync_on_a_homogeneous_rig_reduces_once_per_step(mode):
    """Pins the sync gate: equal speeds -> every rank steps once per reduce; nccl_sync sends
    each reduce order with the batch (no separate SyncNow) and every order after the epoch's
    first ahead of the reduce it follows; cpu_sync still asks for snapshots, orders in turn.
    (nccl_sync as floDl's variant: the exact path has no reduce of its own, see
    test_exact_sync_windows_hand_out_every_step_split_by_speed.)"""
    summary, ranks = _run(mode, [5.0, 5.0], epochs=1, elche=_floDl(mode))
    assert summary.status == "completed", summary.message
    per_rank_batches = NUM_SAMPLES // 2 // 8
    assert summary.syncs == per_rank_batches
    assert set(_positions(ranks, 1).values()) == {1}
    sync_orders = [r.orders.count("SyncNow") for r in ranks]
    assert sync_orders == ([0, 0] if mode == "nccl_sync" else [per_rank_batches] * 2)
    assert [r.ahead for r in ranks] == ([per_rank_batches - 1] * 2 if mode == "nccl_sync" else [0, 0])


@pytest.mark.coordinator
def test_max_batch_diff_bounds_the_lead_within_a_sync_reduce():
    """Pins where the max_batch_diff throttle lives on the coordinator backend: in a sync mode a
    rank 2.5x faster keeps stepping while the slow one works (an extra batch per reduce without
    a limit), but never gets more than M batches ahead of the rank with the fewest: M = 0 is
    one batch each per reduce, lockstep."""
    def leads(ranks):
        per_round = []
        for rank in ranks:  # Train orders between two SyncNow orders = batches of one reduce
            segments = " ".join(rank.orders).split("SyncNow")
            per_round.append([seg.split().count("Train") for seg in segments[:-1]])
        return [max(r) - min(r) for r in zip(*per_round)]

    capped, capped_ranks = _run("cpu_sync", [4.0, 10.0], epochs=1, batch_size=8,
                                elche=replace(ElCheConfig.cpu_sync(), max_batch_diff=0))
    free, free_ranks = _run("cpu_sync", [4.0, 10.0], epochs=1, batch_size=8)
    assert capped.status == free.status == "completed"
    assert set(leads(capped_ranks)) == {0} and max(leads(free_ranks)) >= 1


class _Events(Observer):
    def __init__(self):
        self.events: List[tuple] = []

    def on_event(self, kind: str, message: str) -> None:
        self.events.append((kind, message))


@pytest.mark.coordinator
@pytest.mark.parametrize("mode", ["cpu_sync", "cpu_cadence", "cpu_async"])
def test_snapshot_timeout_leaves_a_late_rank_out_and_folds_its_steps_in_later(mode):
    """Pins snapshot_timeout_secs in every cpu_* mode: a rank whose snapshot of round 2 comes
    1.5 s late (timeout 0.3 s) is left out of that round's average (event snapshot_late), its
    late snapshot's steps fold into its next one (event snapshot_folded), so the averages
    weigh every batch trained exactly once, and every sample is still trained once."""
    events = _Events()
    config = ExperimentConfig(elche=ElCheConfig.preset(mode), num_epochs=2, batch_size=8,
                              snapshot_timeout_secs=0.3)
    secret = new_secret()
    coord = Coordinator(config, 2, secret, observer=events)
    weighed: List[int] = []
    reduce = coord.averager.reduce

    def recording(snapshots, **kwargs):
        weighed.extend(s.steps for s in snapshots)
        return reduce(snapshots, **kwargs)

    coord.averager.reduce = recording
    ranks = [FakeRank(r, 2, coord.address, secret, 4.0, 8, mode) for r in range(2)]
    ranks[1].late_rounds = {2: 1.5}
    for r in ranks:
        r.start()
    summary = coord.run()
    for r in ranks:
        r.join(timeout=10)
    assert summary.status == "completed", summary.message
    kinds = [k for k, _ in events.events]
    assert "snapshot_late" in kinds and "snapshot_folded" in kinds
    assert next(m for k, m in events.events if k == "snapshot_late").startswith("round 2: rank(s) [1]")
    assert set(_positions(ranks, 2).values()) == {1} and len(_positions(ranks, 2)) == 2 * NUM_SAMPLES
    assert sum(weighed) == 2 * NUM_SAMPLES // 8


@pytest.mark.coordinator
def test_nccl_sync_on_an_uneven_rig_orders_the_reduce_apart_from_the_batch():
    """Pins where folding stops: once ElChe knows the speeds (2.5x apart) a window may give
    the fast rank more than one batch, so the reduce is ordered on its own (SyncNow), and every
    sample is still trained exactly once (floDl's parameter-averaging variant)."""
    summary, ranks = _run("nccl_sync", [4.0, 10.0], epochs=1, elche=_floDl("nccl_sync"))
    assert summary.status == "completed", summary.message
    assert set(_positions(ranks, 1).values()) == {1}
    assert all(r.orders.count("SyncNow") > 0 for r in ranks)


@pytest.mark.coordinator
def test_exact_sync_windows_hand_out_every_step_split_by_speed():
    """Pins nccl_sync's exact windows: every rank gets a share of every global step (no
    SyncNow: the all-reduce is inside backward), the shares follow speed once ElChe has
    timed the ranks (rank 0, 2.5x faster, computes about 5/7 of the samples), windows grow
    past one step, and every sample is trained exactly once."""
    summary, ranks = _run("nccl_sync", [4.0, 10.0], epochs=2)
    assert summary.status == "completed", summary.message
    assert set(_positions(ranks, 2).values()) == {1} and len(_positions(ranks, 2)) == 2 * NUM_SAMPLES
    assert all(r.orders.count("SyncNow") == 0 for r in ranks)
    assert summary.epochs[-1].per_rank_batch_share[0] == pytest.approx(5 / 7, abs=0.05)
    assert max(summary.anchor_trajectory) > 1 and summary.syncs < NUM_SAMPLES // 16


@pytest.mark.coordinator
def test_a_lone_exact_rank_runs_its_windows_to_the_cap():
    """Pins nccl_sync with one member: no shares to re-plan, so after its first (untimed)
    window each window runs to the compute cap or the epoch's end, not ElChe's anchor of one
    step (each boundary is a round trip to the coordinator, and on a GPU a wait for the
    device); every sample is still trained once."""
    summary, ranks = _run("nccl_sync", [4.0], epochs=2)
    assert summary.status == "completed", summary.message
    assert set(_positions(ranks, 2).values()) == {1} and len(_positions(ranks, 2)) == 2 * NUM_SAMPLES
    assert summary.syncs <= 3, summary.syncs  # 1 + 1, then 1 for the second epoch


@pytest.mark.coordinator
def test_epochs_are_aggregated_in_order_with_eval():
    """Pins per-epoch records (ascending epochs, eval from the callback rank, shares sum to 1)."""
    summary, _ = _run("nccl_cadence", [5.0, 5.0], epochs=2)
    assert [e.epoch for e in summary.epochs] == [0, 1]
    assert all(e.eval == 0.5 for e in summary.epochs)
    assert summary.final_eval == 0.5
    for e in summary.epochs:
        assert abs(sum(e.per_rank_batch_share) - 1.0) < 1e-9


def test_unauthenticated_frames_are_dropped_and_counted():
    """Pins the HMAC check: a frame signed with another key is dropped, never parsed."""
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")
    good, bad = new_secret(), new_secret()
    Channel(client, bad).send(Heartbeat(7))
    Channel(client, good).send(Heartbeat(1))
    receiver = Channel(server, good)
    got = receiver.recv(timeout_ms=5000)
    assert got.message == Heartbeat(1)
    assert receiver.rejected == 1
    client.close()
    server.close()


class _KeepBundles(Observer):
    """Copies the meta of every checkpoint as it is written (later saves reuse the stem)."""

    def __init__(self, stem):
        self.stem, self.metas = stem, []

    def on_event(self, kind, message):
        if kind == "checkpoint":
            self.metas.append(read_meta(self.stem))


@pytest.mark.coordinator
@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence"])
def test_mid_epoch_checkpoint_and_resume_cover_each_sample_exactly_once(tmp_path, mode):
    """Pins checkpoint_at_epoch: the bundle lists what of the epoch its weights do not include,
    and a resume trains exactly those samples of that epoch (then whole epochs), so the two
    runs together train every sample of every epoch once."""
    stem = str(tmp_path / "ck")
    keep = _KeepBundles(stem)
    summary, first = _run(mode, [4.0, 10.0], epochs=3, checkpoint_at_epoch=1, save_path=stem,
                          observer=keep)
    assert summary.status == "completed", summary.message
    mid = keep.metas[0]
    assert mid.epoch == 1 and mid.coverage.uncovered and mid.save_reason == "checkpoint"
    before = _positions(first, 3)
    uncovered = {(p, i) for p, s, e in mid.coverage.uncovered for i in range(s, e)}
    # what the mid-epoch weights include of epoch 1 = trained in the first run minus uncovered
    included = {k for k in before if k[0] == 1} - uncovered
    save_meta(str(tmp_path / "mid"), mid)  # the bundle as it stood mid-epoch
    summary2, second = _run(mode, [4.0, 10.0], epochs=3, resume_from=str(tmp_path / "mid"))
    assert summary2.status == "completed", summary2.message
    assert [e.epoch for e in summary2.epochs] == [1, 2]
    after = _positions(second, 3)
    epoch1 = Counter({k: v for k, v in after.items() if k[0] == 1})
    assert set(epoch1) == uncovered and set(epoch1.values()) == {1}
    assert included | set(epoch1) == {(1, i) for i in range(NUM_SAMPLES)}


@pytest.mark.coordinator
def test_a_resume_whose_uncovered_ranges_lie_outside_the_epoch_fails_naming_them(tmp_path):
    """Pins: out-of-range `uncovered` ranges in a meta gave empty batches and a `nonfinite`
    failure. Only the ranks know the train set's size, so the coordinator checks them once the
    ranks joined: the run fails before training, naming the field and the epoch's samples."""
    stem = str(tmp_path / "ck")
    keep = _KeepBundles(stem)
    summary, _ = _run("cpu_cadence", [4.0, 10.0], epochs=2, checkpoint_at_epoch=1, save_path=stem,
                      observer=keep)
    assert summary.status == "completed", summary.message
    mid = keep.metas[0]
    mid.coverage.uncovered = [[1, NUM_SAMPLES + 8, NUM_SAMPLES + 16]]
    save_meta(str(tmp_path / "mid"), mid)  # an edit with its checksum made good
    summary2, ranks = _run("cpu_cadence", [4.0, 10.0], epochs=2, resume_from=str(tmp_path / "mid"))
    assert summary2.status == "failed" and summary2.epochs == []
    assert summary2.message.startswith("resume_from: coverage.uncovered.0 [1, "), summary2.message
    assert not any(r.slices for r in ranks)
