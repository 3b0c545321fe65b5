#!/usr/bin/env bash
# Fault drills on two GPUs over NCCL, for the device tool (nvidia-h200-x2):
#   bash tools/device_run.sh bash tools/gpu_drill.sh
# 1. nccl_sync, rank 1 SIGKILLed after its 30th batch: rank 0 is then inside the reduce with it.
# 2. nccl_cadence, the same fault: rank 0 is mid-window.
# 3. nccl_sync, rank 1 SIGSTOPped (alive to the OS, silent to us) with a 5 s heartbeat timeout.
# Each must end `completed` on rank 0 alone, every sample of every epoch trained, within the
# heartbeat timeout + 10 s of the death. Per drill: status, wall, detection and death-to-end
# times, samples per epoch against the epoch's size. Run dirs stay in /tmp; drills.md, the
# summaries and the launcher output go to $OUT (8 files). About 80 s on two H200s.
set -uo pipefail
OUT=${OUT:-/tmp/out}
RUN=/tmp/gpu_drill
mkdir -p "$OUT"
rm -rf "$RUN"; mkdir -p "$RUN"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' \
  | tee -a "$OUT/gpu.txt"

drill() {  # name heartbeat_s fault overrides...
  local name=$1 heartbeat=$2 fault=$3
  shift 3
  echo "== $name: FLODL_RUN_FAULT=$fault heartbeat_timeout_secs=$heartbeat $*"
  FLODL_RUN_FAULT=$fault timeout 150 python3 -m flodl_run tracking=off hydra.run.dir="$RUN/$name" \
    cluster=local_gpus 'cluster.devices=[0,1]' recipe=digits_cnn num_epochs=4 \
    heartbeat_timeout_secs="$heartbeat" "$@" > "$RUN/$name.out" 2>&1
  echo "exit $?" >> "$RUN/$name.out"
  mkdir -p "$OUT/$name"
  cp "$RUN/$name.out" "$OUT/$name/launcher.out"
  cp "$RUN/$name/summary.json" "$OUT/$name/" 2>/dev/null  # 8 files in all: the device tool's limit
  tail -n 3 "$RUN/$name.out"
}

drill sigkill_nccl_sync 30 1:30:SIGKILL elche=nccl_sync
drill sigkill_nccl_cadence 30 1:30:SIGKILL elche=nccl_cadence
drill sigstop_nccl_sync 5 1:30:SIGSTOP elche=nccl_sync

python3 - "$RUN" <<'PY' | tee "$OUT/drills.md"
import datetime, json, re, sys
from pathlib import Path

from flodl_run.config.compose import experiment_from_yaml
from flodl_run.control.dispatch import epoch_span
from flodl_run.contracts.recipe import load_recipe

run = Path(sys.argv[1])
print("| drill | status | exit | wall s | heartbeat s | silent before declared dead s "
      "| death to end s | bound s | samples per epoch (expected) |")
print("|---|---|---|---|---|---|---|---|---|")
for name in ("sigkill_nccl_sync", "sigkill_nccl_cadence", "sigstop_nccl_sync"):
    out = (run / f"{name}.out").read_text()
    code = re.findall(r"^exit (\d+)", out, re.M)[-1]
    summary_file = run / name / "summary.json"
    if not summary_file.exists():
        print(f"| {name} | no summary.json | {code} | | | | | | |")
        continue
    summary = json.loads(summary_file.read_text())
    config = experiment_from_yaml((run / name / "run.yaml").read_text())
    recipe = load_recipe(config)
    size = len(recipe.call("train_dataset"))
    expected = [epoch_span(e["epoch"], size, config.data.augment, config.data.epoch_splits).size
                for e in summary["epochs"]]
    log = (run / name / "cli.log").read_text()
    lost = re.search(r"\[([0-9-]+ [0-9:,]+)\]\S* - rank 1 lost: (.*)", log)
    silent, to_end = "", ""
    if lost:
        at = datetime.datetime.strptime(lost.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        quiet = re.search(r"silent for ([0-9.]+)s", lost.group(2))
        death = at - float(quiet.group(1)) if quiet else at  # SIGKILL: the exit is seen in 0.2 s
        silent = quiet.group(1) if quiet else "(exit seen)"
        to_end = f"{summary_file.stat().st_mtime - death:.1f}"
    heartbeat = config.heartbeat_timeout_secs
    samples = ", ".join(f"{e['samples']} ({x})" for e, x in zip(summary["epochs"], expected))
    print(f"| {name} | {summary['status']} | {code} | {summary['wall_s']:.1f} | {heartbeat:g} "
          f"| {silent} | {to_end} | {heartbeat + 10:g} | {samples} |")
PY
