#!/usr/bin/env bash
# GPU checks of the data plane, for the device tool:
#   bash tools/device_run.sh bash tools/gpu_dataplane.sh
# Writes under $OUT: throughput.json (resident vs streaming vs DataLoader(pin_memory=True)),
# oom.json (fallback), fits/ nofit/ pair/ run dirs, and dataplane.txt (what to report).
# Streaming is forced by shrinking the data plane's budget (FLODL_RUN_SIM_DEVICE_BYTES), never
# the GPU; the OOM case caps the allocator of its own process.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/dataplane.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
python3 tools/dataplane_bench.py throughput --out "$OUT/throughput.json"
python3 tools/dataplane_bench.py oom --out "$OUT/oom.json"

# Full runs: synthetic_mlp with 1M samples x 256 features (0.8 GB of train set).
BIG="recipe=synthetic_mlp recipe.params.num_samples=1000000 recipe.params.in_features=256 batch_size=1024 num_epochs=3 eval_every_epochs=3 tracking=off"
python3 -m flodl_run $BIG cluster=solo hydra.run.dir="$OUT/fits" | tail -n 1
FLODL_RUN_SIM_DEVICE_BYTES=1.5e9 python3 -m flodl_run $BIG cluster=solo hydra.run.dir="$OUT/nofit" | tail -n 1
# Two ranks on the one GPU (coordinator backend, no NCCL): rank 1's budget shrunk, rank 0's not.
FLODL_RUN_SIM_DEVICE_BYTES_1=1.5e9 python3 -m flodl_run $BIG cluster=local_gpus 'cluster.devices=[0,0]' \
  elche=cpu_cadence hydra.run.dir="$OUT/pair" | tail -n 1

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
expect = {"fits": ["resident"], "nofit": ["streaming"], "pair": ["resident", "streaming"]}
ok = True
for name, modes in expect.items():
    try:
        s = json.load(open(f"{out}/{name}/summary.json"))
    except OSError as exc:
        print(f"{name}: no summary ({exc})"); ok = False; continue
    last = s["epochs"][-1] if s["epochs"] else {}
    got = last.get("per_rank_delivery")
    ok &= s["status"] == "completed" and got == modes
    print(f"{name:6s} status={s['status']} samples/s={s['samples_per_s']:,.0f} delivery={got} (expect {modes})")
    for e in s["epochs"]:
        print(f"   epoch {e['epoch']}: delivery={e['per_rank_delivery']} "
              f"starve_ms={[round(x, 1) for x in e['per_rank_data_starve_ms']]} "
              f"hit={[{k: round(v, 3) for k, v in h.items()} for h in e['per_rank_cache_hit_rate']]} "
              f"samples/s={[round(x) for x in e['per_rank_throughput']]}")
t = json.load(open(f"{out}/throughput.json"))
print(f"\nthroughput, {t['gpu']}, {t['samples']:,} x {t['features']} float32 ({t['set_gb']:.2f} GB), batch {t['batch']}, last epoch:")
print("| delivery | samples/s | wait ms/step | data-starve ms/step | mode |")
print("|---|---:|---:|---:|---|")
for name, epochs in t.items():
    if isinstance(epochs, list):
        e = epochs[-1]
        starve = e.get("starve_ms_per_step")
        print(f"| {name} | {e['samples_per_s']:,.0f} | {e['wait_ms_per_step']:.3f} | "
              f"{'-' if starve is None else f'{starve:.3f}'} | {e.get('delivery', '-')} |")
for name, mode in (("dataplane_resident", "resident"), ("dataplane_streaming", "streaming"),
                   ("dataplane_streaming_pool", "streaming")):
    got = t[name][-1].get("delivery")
    ok &= got == mode
    print(f"{name}: mode {got} (expect {mode})")
o = json.load(open(f"{out}/oom.json"))
ok &= o["ok"]
print(f"\noom fallback ok={o['ok']} delivery={o['delivery']} warnings={o['warnings']}")
print("ALL OK" if ok else "SOMETHING FAILED")
PY
