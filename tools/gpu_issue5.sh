#!/usr/bin/env bash
# GPU checks of the coordinator-backed modes and the in-process path, for the device tool:
#   bash tools/device_run.sh bash tools/gpu_issue5.sh
# Two ranks share the one GPU (the coordinator backend needs no NCCL); rank 1 emulated 2.5x slower.
set -uo pipefail
OUT=${OUT:-/tmp/out}
BIG="recipe=synthetic_mlp recipe.params.hidden=4096 recipe.params.depth=4 recipe.params.num_samples=65536 batch_size=512 num_epochs=3 tracking=off"
python3 tools/roundtrip.py --rounds 10
python3 -m flodl_run $BIG cluster=solo hydra.run.dir=$OUT/solo | tail -n 2
for mode in cpu_sync cpu_cadence cpu_async; do
  python3 -m flodl_run $BIG cluster=local_gpus 'cluster.devices=[0,0]' 'cluster.emulate_slowdown=[1.0,2.5]' \
    elche=$mode hydra.run.dir=$OUT/$mode | tail -n 2
done
python3 - "$OUT" <<'PY'
import json, sys
for name in ("solo", "cpu_sync", "cpu_cadence", "cpu_async"):
    s = json.load(open(f"{sys.argv[1]}/{name}/summary.json"))
    last = s["epochs"][-1]
    ms = [512 * 1000 / t if t else None for t in last["per_rank_throughput"]]
    print(f"{name:12s} status={s['status']} wall_s={s['wall_s']:.1f} samples/s={s['samples_per_s']:.0f} "
          f"syncs={s['syncs']} avg_sync_ms={s['avg_sync_ms']:.1f} final_eval={s['final_eval']} "
          f"share={[round(x, 2) for x in last['per_rank_batch_share']]} ms/batch={[round(m, 2) for m in ms if m]} "
          f"idle={[round(x, 3) for x in s.get('idle_fraction', [])]}")
PY
