#!/usr/bin/env bash
# The GPU table of docs/benchmarks.md, for the device tool (one H200):
#   bash tools/device_run.sh bash tools/gpu_bench.sh
# Solo at each rank speed, then two ranks sharing the one GPU in the cpu_* modes (the
# coordinator backend needs no NCCL, so ranks may share a device) with rank 1 emulated 2.5x
# slower. torch DDP needs one GPU per rank (NCCL), so it is left out here. Run dirs stay in /tmp
# (every run ends with a ~200 MB checkpoint); bench.json, bench.md, bench.png, the summaries
# and the measured step time go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
RUN=/tmp/gpu_bench
PARAMS='"recipe.params.hidden=4096","recipe.params.depth=4","recipe.params.num_samples=65536","recipe.params.lr=0.02"'
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# One step of the recipe must take >= 5 ms on the GPU: measure it the way a rank steps.
python3 - <<'PY' | tee "$OUT/step_ms.txt"
import time, torch
from flodl_run.contracts.recipe import import_recipe
from flodl_run.rank.replica import Replica
recipe = import_recipe("recipes.synthetic_mlp", {"hidden": 4096, "depth": 4, "num_samples": 65536})
replica = Replica(recipe, torch.device("cuda"), 0)
x, y = (t[:512].cuda() for t in recipe.call("train_dataset").tensors)
for _ in range(10):
    replica.step((x, y))
torch.cuda.synchronize()
began = time.perf_counter()
for _ in range(50):
    replica.step((x, y))
torch.cuda.synchronize()
params = sum(p.numel() for p in replica.model.parameters())
print(f"synthetic_mlp hidden 4096 depth 4, batch 512: {(time.perf_counter() - began) / 50 * 1000:.2f} ms per step, {params / 1e6:.1f} M parameters")
PY

python3 -m flodl_run.bench tracking=off hydra.run.dir=$RUN \
  cluster=local_gpus 'cluster.devices=[0,0]' 'cluster.emulate_slowdown=[1.0,2.5]' \
  'bench.modes=[cpu_sync,cpu_cadence,cpu_async]' bench.torch_ddp=false \
  bench.epochs=3 bench.batch_size=512 bench.timeout_s=300 \
  "bench.recipes=[{name:synthetic_mlp,overrides:[$PARAMS],target_eval:0.7}]"
status=$?
cp "$RUN"/bench.json "$RUN"/bench.md "$RUN"/bench.png "$OUT"/ 2>/dev/null
for d in "$RUN"/synthetic_mlp/*/; do
  name=$(basename "$d")
  mkdir -p "$OUT/runs/$name"
  cp "$d"summary.json "$d"output.log "$OUT/runs/$name/" 2>/dev/null
done
exit $status
