#!/usr/bin/env bash
# One-GPU checks of the rank start paths, for the device tool on nvidia-h200 (one GPU is enough):
#   device run, carry [".whl"]:  bash tools/device_run.sh bash tools/gpu_zygote.sh
# 1. `cluster=auto` on one GPU: the in-process run (the spare zygote is dismissed).
# 2. Two ranks sharing GPU 0 (cluster.devices=[0,0], elche=cpu_cadence: the coordinator
#    averages, no NCCL between ranks on one device), started each way: one interpreter per rank
#    (spawn, the GPU default) and forked from the spare zygote (FLODL_RUN_RANK_START=zygote).
#    Per run: wall seconds, seconds to the first epoch line, the done line.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/zygote.txt"

timed() {  # timed LABEL ENV... -- ARGS...: wall, first epoch, done line
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local t0; t0=$(date +%s%N)
  env "${envs[@]}" python3 -m flodl_run tracking=off "hydra.run.dir=/tmp/z_$label" "$@" 2>&1 \
    | while IFS= read -r line; do
        case "$line" in epoch\ 1/*) echo "first_epoch_ms=$(( ($(date +%s%N) - t0) / 1000000 ))";; esac
        case "$line" in done:*|failed*|interrupted*|*Error*) echo "$line";; esac
      done
  local log=none
  [ -f "/tmp/z_$label/ranks/zygote.log" ] && log=$(wc -c < "/tmp/z_$label/ranks/zygote.log")
  echo "$label wall_ms=$(( ($(date +%s%N) - t0) / 1000000 )) zygote_log_bytes=$log"
}

{
  timed solo_gpu FLODL_X=1 -- num_epochs=2
  for round in 1 2 3; do
    for start in spawn zygote; do
      timed "pair_${start}_$round" FLODL_RUN_RANK_START=$start -- cluster=local_gpus \
        "cluster.devices=[0,0]" elche=cpu_cadence num_epochs=3
    done
  done
} 2>&1 | tee -a "$OUT/zygote.txt"
