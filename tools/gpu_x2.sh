#!/usr/bin/env bash
# The two-GPU tables of docs/benchmarks.md, for the device tool on nvidia-h200-x2:
#   cp ../shared/probes/gpu_anchors.py .whl/      # once per checkout (optional: the peer probe)
#   device run, carry [".whl"]:  bash tools/device_run.sh bash tools/gpu_x2.sh STAGE...
# Stages (any order, several per call):
#   probe   the peers as ../shared/probes/gpu_anchors.py measures them, and one flodl_run reduce
#           against the bare NCCL all-reduce of the same bytes (tools/reduce_cost.py)
#   homog   bench on a homogeneous pair: bare solo, runner solo, torch DDP, nccl_sync,
#           nccl_cadence, torch local SGD (synthetic_mlp, 51.4 M parameters, batch 512)
#   homog_tl  homog, with nccl_cadence run again under timeline=true (the trace's cost)
#   lm_trace  byte_lm on the [1.0, 2.5] pair, nccl_cadence, timeline=true: the trace comes back
#   hetero  the same rig with rank 1 emulated 2.5x slower: nccl_cadence and the cpu_* modes
#   lm      both rigs on the byte-level transformer (recipe byte_lm): ~10 min, past one call's
#           limit with the other stages; lm_homog and lm_hetero run one rig each
# Run dirs stay in /tmp on the machine; bench.md/bench.json of each stage go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export FLODL_RUN_WAITS=1  # each rank logs where its idle time went (one line at the end)
GPUS="cluster=local_gpus cluster.devices=[0,1]"
MLP='"recipe.params.hidden=4096","recipe.params.depth=4","recipe.params.num_samples=131072","recipe.params.lr=0.02"'
MLP_RECIPE="bench.recipes=[{name:synthetic_mlp,overrides:[$MLP],target_eval:0.7}]"
COMMON="tracking=off bench.timeout_s=240"

bench() {  # bench NAME overrides...
  local name=$1; shift
  echo "== bench $name: $*"
  python3 -m flodl_run.bench hydra.run.dir=/tmp/bench_$name $COMMON "$@" 2>&1 | tail -40
  grep -h "waits:" /tmp/bench_$name/*/*/output.log 2>/dev/null | cut -c1-700
  cp /tmp/bench_$name/bench.md "$OUT/bench_$name.md" 2>/dev/null
  cp /tmp/bench_$name/bench.json "$OUT/bench_$name.json" 2>/dev/null
}

for stage in "$@"; do
  case $stage in
    probe)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      nvidia-smi topo -m 2>/dev/null | head -4
      if [ -f .whl/gpu_anchors.py ]; then
        torchrun --nproc-per-node 2 .whl/gpu_anchors.py 2>&1 | grep -v '^W1\|\*\*\*' | tee "$OUT/anchors.txt"
      fi
      torchrun --nproc-per-node 2 tools/reduce_cost.py --params 51400000 --rounds 20 2>&1 \
        | grep -v '^W1\|\*\*\*' | tee "$OUT/reduce_cost.txt"
      ;;
    homog)
      bench homog_mlp $GPUS bench.epochs=5 bench.batch_size=512 "bench.modes=[nccl_sync,nccl_cadence]" "$MLP_RECIPE"
      ;;
    homog_tl)  # homog again, with nccl_cadence run a second time under timeline=true
      bench homog_tl_mlp $GPUS bench.epochs=5 bench.batch_size=512 "bench.modes=[nccl_sync,nccl_cadence]" \
        "bench.timeline=[nccl_cadence]" "$MLP_RECIPE"
      ;;
    hetero)
      bench hetero_mlp $GPUS "cluster.emulate_slowdown=[1.0,2.5]" bench.epochs=5 bench.batch_size=512 \
        bench.runner_solo=false "bench.modes=[nccl_cadence,cpu_cadence,cpu_async]" "$MLP_RECIPE"
      ;;
    lm|lm_homog|lm_hetero)
      # 4 MB of the stdlib text (15.6 K windows of 256 bytes), batch 64: ~120 steps per rank
      # per epoch on the pair, 3 epochs
      LM='bench.recipes=[{name:byte_lm,overrides:["recipe.params.max_bytes=4000000"]}]'
      [ "$stage" = lm_hetero ] || bench homog_lm $GPUS bench.epochs=3 bench.batch_size=${LM_BATCH:-64} \
        "bench.modes=[nccl_sync,nccl_cadence]" "$LM"
      [ "$stage" = lm_homog ] || bench hetero_lm $GPUS "cluster.emulate_slowdown=[1.0,2.5]" bench.epochs=3 \
        bench.batch_size=${LM_BATCH:-64} bench.runner_solo=false "bench.modes=[nccl_cadence]" "$LM"
      ;;
    lm_trace)  # one nccl_cadence run of byte_lm on the [1.0, 2.5] pair with timeline=true
      python3 -m flodl_run $GPUS "cluster.emulate_slowdown=[1.0,2.5]" recipe=byte_lm \
        recipe.params.max_bytes=4000000 batch_size=${LM_BATCH:-64} num_epochs=3 tracking=off \
        timeline=true hydra.run.dir=/tmp/lm_trace 2>&1 | tail -8
      grep -h "waits:" /tmp/lm_trace/ranks/*.log 2>/dev/null | cut -c1-900
      mkdir -p "$OUT/lm_trace"
      cp /tmp/lm_trace/timeline.json /tmp/lm_trace/summary.json /tmp/lm_trace/events.jsonl "$OUT/lm_trace/"
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
