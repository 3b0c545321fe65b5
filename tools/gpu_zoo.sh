#!/usr/bin/env bash
# The zoo on one H200, for the device tool (carry .whl):
#   bash tools/device_run.sh bash tools/gpu_zoo.sh [speed] [profile] [matrix] [compiled] [unused]
# speed:    the solo path against a careful user's own loop, 4 epochs x 8 paired rounds each (which
#           runs first alternates; --phases: the median delivery and step calls of each);
#           every zoo model (or $SPEED_MODELS), each build of $SPEED_BUILDS (default eager)
# profile:  where the host's time goes in both loops (torch.profiler), zoo_frozen and zoo_gpt2, eager
# matrix:   every zoo model in solo and the five modes, two ranks sharing GPU 0, eager (and
#           compiled with `compiled`)
# unused:   zoo_unused compiled in the five two-rank modes, every failure's log kept
# Results go to $OUT (speed.jsonl, profile-*.txt, matrix*/).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, torchvision, transformers; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
MODELS=$(ls conf/recipe/zoo_*.yaml | xargs -n1 basename | sed 's/\.yaml//')
ARGS=" $* "
# A matrix's table, and the logs of its cells that did not complete (run dirs stay in /tmp).
keep() {
  mkdir -p "$OUT/$2"
  cp "$1"/matrix.md "$1"/matrix.json "$OUT/$2/" 2>/dev/null
  python3 - "$1" "$OUT/$2" <<'PY'
import json, shutil, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for run in src.iterdir():
    summary = run / "summary.json"
    status = json.loads(summary.read_text()).get("status") if summary.exists() else "none"
    if run.is_dir() and status != "completed":
        for log in [*run.glob("*.log"), *run.glob("ranks/*.log")]:
            shutil.copy(log, dst / f"{run.name}-{log.name}")
PY
}

if [[ $ARGS == *" profile "* ]]; then
  for m in zoo_frozen zoo_gpt2; do
    python3 tools/zoo_speed.py "$m" --device cuda --epochs 6 --rounds 1 --trace --out /tmp/zs \
      > "$OUT/profile-$m.txt" 2>&1
    tail -1 "$OUT/profile-$m.txt"
  done
fi

if [[ $ARGS == *" speed "* ]]; then
  for m in ${SPEED_MODELS:-$MODELS}; do
    for b in ${SPEED_BUILDS:-eager}; do
      flag=""; [ "$b" = compiled ] && flag="--compiled"
      line=$(python3 tools/zoo_speed.py "$m" --device cuda --epochs 4 --rounds 8 --phases $flag --out /tmp/zs 2>/tmp/zs.err | tail -1)
      [ -n "$line" ] || { line=null; tail -5 /tmp/zs.err; }
      echo "{\"model\": \"$m\", \"build\": \"$b\", \"result\": $line}" >> "$OUT/speed.jsonl"
      python3 -c "import json,sys; d=json.loads(sys.argv[1]); r=d['result'] or {}; print(d['model'], d['build'], 'ratio', r.get('ratio'), r.get('ratios'))" "$(tail -1 "$OUT/speed.jsonl")"
    done
  done
fi

if [[ $ARGS == *" unused "* ]]; then
  python3 tools/zoo_matrix.py --device cuda --epochs 1 --jobs 5 --compiled --models zoo_unused \
    --paths nccl_sync,nccl_cadence,cpu_sync,cpu_cadence,cpu_async --out /tmp/unused 2>&1 | tail -40
  keep /tmp/unused unused
fi

if [[ $ARGS == *" matrix "* ]]; then
  python3 tools/zoo_matrix.py --device cuda --epochs ${MATRIX_EPOCHS:-2} --jobs 8 --out /tmp/matrix 2>&1 | tail -14
  keep /tmp/matrix matrix
  if [[ $ARGS == *" compiled "* ]]; then
    python3 tools/zoo_matrix.py --device cuda --epochs 1 --jobs 8 --compiled --out /tmp/matrix_c 2>&1 | tail -24
    keep /tmp/matrix_c matrix_c
  fi
fi
