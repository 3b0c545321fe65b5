#!/usr/bin/env bash
# nccl_sync with one rank on one H200 against the solo path, compiled byte_lm (bf16, fused AdamW,
# batch 256), for the device tool (carry .whl):
#   bash tools/device_run.sh bash tools/gpu_onerank.sh
#   SPLIT=1 bash tools/device_run.sh bash tools/gpu_onerank.sh    # and a timeline of each path
#   BENCH=0 SPLIT=1 bash tools/device_run.sh bash tools/gpu_onerank.sh   # the timelines only
# The bench runs the bare loop (solo@1.0), flodl_run's in-process path (runner_solo@1.0) and the
# one-rank nccl_sync run, 3 rounds each (the first one compiles on a cold inductor cache; the
# median drops it). Run dirs stay in /tmp; bench.json and bench.md go to $OUT, and the bench's
# log goes there as it runs (a call cut at its time limit still returns it). On 2026-12-05 the
# 10 MB default did not finish within 6.5 minutes of one H100; 3 MB is the default now.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
status=0
if [ "${BENCH:-1}" = 1 ]; then
  python3 -m flodl_run.bench tracking=off hydra.run.dir=/tmp/onerank \
    cluster=local_gpus 'cluster.devices=[0]' 'bench.modes=[nccl_sync]' \
    "bench.recipes=[{name:byte_lm,overrides:['recipe.params.max_bytes=${MAX_BYTES:-3000000}']}]" \
    bench.torch_ddp=false bench.torch_localsgd=false bench.batch_size=256 bench.epochs=3 \
    bench.repeats=3 bench.timeout_s=400 2>&1 | tee "$OUT/onerank.log"
  status=${PIPESTATUS[0]}
  cp /tmp/onerank/bench.json /tmp/onerank/bench.md "$OUT/" 2>/dev/null
fi
# SPLIT=1: then one run of each path with the timeline on (the rank's first epoch part, which
# holds the compile, took 1.1-1.3 s more than in process on 2026-12-05): timeline.json,
# summary.json and the rank's log of each go to $OUT/split-<path>/.
# Each path runs twice, in turn, and the second run of each is kept: both on a warm inductor
# cache (the first solo run of a fresh machine compiled cold: 38 s against 5 s).
if [ "${SPLIT:-0}" = 1 ]; then
  for run in solo-1 nccl_sync-1 solo nccl_sync; do
    path=${run%-1}
    rig=(cluster=solo)
    [ $path = solo ] || rig=(cluster=local_gpus 'cluster.devices=[0]' elche=nccl_sync)
    FLODL_RUN_WAITS=1 python3 -m flodl_run recipe=byte_lm "recipe.params.max_bytes=${MAX_BYTES:-3000000}" \
      batch_size=256 num_epochs=1 data.epoch_splits=4 timeline=true tracking=off "${rig[@]}" \
      hydra.run.dir=/tmp/split-$run > /tmp/split-$run.log 2>&1
    [ $run = $path ] || continue  # the warm-up run
    mkdir -p "$OUT/split-$path"
    cp /tmp/split-$path.log /tmp/split-$path/timeline.json /tmp/split-$path/summary.json "$OUT/split-$path/" 2>/dev/null
    cp /tmp/split-$path/ranks/*.log "$OUT/split-$path/" 2>/dev/null
  done
fi
exit $status
