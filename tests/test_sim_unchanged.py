"""The simulator's results, pinned from the per-rank Python code (commit 810ae0a) before the
per-window vectorisation: same plans, same samples/s, to the last bit."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest

from flodl_run.config.schema import ElCheConfig, SyncAverage
from flodl_run.sim.cli import sim_json
from flodl_run.sim.rig import ColdStartSkew, RankGroup, SimConfig, simulate

# The keys sim.json had when the pins were taken; later keys stay out of the digest.
WINDOW_KEYS = ("window", "phase", "anchor", "anchor_rank", "batch_counts", "overhead",
               "divergence", "verdict", "nudge_factor")
SUMMARY_KEYS = ("samples_per_s", "ideal_samples_per_s", "ratio_to_ideal", "idle_fraction",
                "reduces_to_settle")
GEN3 = [RankGroup(32, 8.0), RankGroup(16, 14.0), RankGroup(16, 30.0)]
RIGS = {
    "two_ranks": (SimConfig(rank_ms=[10.0, 25.0], sync_ms=5.0, windows=60), ElCheConfig()),
    "gen3_64": (SimConfig(groups=GEN3, sync_ms=40.0, sync_ms_per_rank=0.5, noise=0.03,
                          windows=200), ElCheConfig()),
    "async_skew_drift": (SimConfig(groups=[RankGroup(4, 10.0), RankGroup(3, 18.0, drift=0.001),
                                           RankGroup(2, 30.0)],
                                   noise=0.05, windows=60, fill_ms=3.0,
                                   cold_start_skew=ColdStartSkew(0, 3.0, 2)),
                         ElCheConfig.cpu_async()),
    "cadence_capped": (SimConfig(rank_ms=[5.0, 9.0, 9.5, 20.0, 40.0, 41.0], noise=0.05,
                                 sync_ms=12.0, windows=80, epoch_batches=150, lr_drops=[30, 60],
                                 drift=[0.0, 0.002, 0.0, -0.001, 0.0, 0.0]),
                       ElCheConfig.cpu_cadence()),
    "sync_gen3": (SimConfig(groups=GEN3, sync_ms=40.0, sync_ms_per_rank=0.5, noise=0.05,
                            windows=50), replace(ElCheConfig.nccl_sync(),
                                          sync_average=SyncAverage.params)),
    "batch_diff": (SimConfig(rank_ms=[10.0, 12.0, 31.0], noise=0.02, sync_ms=30.0, windows=60),
                   ElCheConfig(max_batch_diff=3)),
    "wide_1024": (SimConfig(groups=[RankGroup(512, 10.0), RankGroup(256, 18.0),
                                    RankGroup(256, 30.0)], noise=0.05, windows=100),
                  ElCheConfig()),
}
# rig: (samples/s, batches over all windows, sha256 of sim.json's pinned keys, first 16 hex)
EXPECTED = {
    "two_ranks": (4360.78431372549, 2085, "3e89300d5d43b793"),
    "gen3_64": (160095.64872479753, 1563610, "ddfc16d880a5b523"),
    "async_skew_drift": (17785.2646611706, 11209, "056d144d0bc1ae4e"),
    "cadence_capped": (14480.236962851053, 11506, "a29b870a610f6f54"),
    "sync_gen3": (51672.938654748315, 8675, "540f49de4f79bacb"),
    "batch_diff": (5816.587725111365, 6069, "bd58534939d263fa"),
    "wide_1024": (1935453.6181173215, 2229515, "c0f92a8981d31101"),
}


@pytest.mark.parametrize("name", sorted(RIGS))
def test_sim_results_unchanged(name: str) -> None:
    """Pins every window's plan and the summary of seven rigs (noise, drift, cold start, fill,
    epoch cap, LR drops, max_batch_diff, sync/cadence/async, 1024 ranks) to the values of the
    per-rank code: a vectorised ElChe or rig that rounds, sums or orders differently fails."""
    sim, elche = RIGS[name]
    doc = sim_json(simulate(sim, elche))
    pinned = {"windows": [{k: w[k] for k in WINDOW_KEYS} for w in doc["windows"]],
              "summary": {k: doc["summary"][k] for k in SUMMARY_KEYS}}
    digest = hashlib.sha256(json.dumps(pinned, sort_keys=True).encode()).hexdigest()[:16]
    batches = sum(sum(w["batch_counts"]) for w in doc["windows"])
    assert (doc["summary"]["samples_per_s"], batches, digest) == EXPECTED[name]
