#!/usr/bin/env bash
# GPU check of the shared-memory parameter path (the round trip, and the GPU benchmark
# table), for the device tool (one H200):
#   bash tools/device_run.sh bash tools/gpu_shm.sh
# 1. tools/roundtrip.py, 10 M parameters, frames then --shm, on the machine's 16-core CPU;
# 2. tools/gpu_bench.sh (two ranks sharing the GPU in the cpu_* modes, which now use /dev/shm);
# 3. what the runs' summaries say of the node (GPU facts from the ranks) and the transport.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
df -h /dev/shm | tee "$OUT/shm.txt"
for mode in "" --shm; do
  python3 tools/roundtrip.py --params 10000000 --rounds 10 $mode
done 2>&1 | tee "$OUT/roundtrip.txt"
OUT="$OUT" bash tools/gpu_bench.sh > "$OUT/bench_stdout.txt" 2>&1
status=$?
tail -20 "$OUT/bench_stdout.txt"
python3 - "$OUT" <<'PY' | tee "$OUT/summaries.txt"
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1], "runs").glob("*/summary.json")):
    s = json.loads(f.read_text())
    print(f.parent.name, s["status"], "transport", s.get("param_transport"), "syncs", s["syncs"],
          "avg sync ms", round(s["avg_sync_ms"], 1), "nodes", s.get("nodes"))
PY
ls /dev/shm | grep -c flodl_run || true
exit $status
