#!/usr/bin/env bash
# Every GPU check of the project in one command, at most 8 minutes on one GPU:
#   bash tools/gpu/run_all.sh            (on a lent CUDA machine; logs go to $OUT or /tmp/cauto-gpu)
#   REHEARSE=1 bash tools/gpu/run_all.sh (here, without a GPU: imports and argument parsing only)
# Prints one summary table (check, exit code, seconds) and exits non-zero when any check failed.
# Missing Python packages travel as wheels in .whl/ (see /work/.library/device/README.md).
set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
LOGS=${OUT:-/tmp/cauto-gpu}
mkdir -p "$LOGS"
export PYTHONPATH=${PYTHONPATH:-}
if ! python3 -c "import pulp, jsonschema" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
for src in "$ROOT"/packages/*/src; do PYTHONPATH=$src:$PYTHONPATH; done
export PYTHONPATH PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$LOGS/device.txt"

# name | seconds allowed | command   (the budgets add up to 7.5 minutes)
CHECKS=(
  "profiler_memory|150|python3 tools/gpu/check_profiler_memory.py"
  "runtime|150|python3 tools/gpu/check_runtime.py --dim 1024 --layers 8 --seq 512 --batch 8"
  "chunks|150|python3 tools/gpu/check_chunks.py --budget-gib 1 --dim 1024 --time-limit 60"
)
summary="| check | exit | seconds |\n|---|---:|---:|"
failed=0
for entry in "${CHECKS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$entry"
  if [ -n "${REHEARSE:-}" ]; then  # load the script as a module: its imports run, its main does not
    script=$(echo "$cmd" | awk '{print $2}')
    cmd="python3 tools/gpu/rehearse.py $script"
  fi
  echo "=== $name: $cmd"
  start=$(date +%s)
  timeout -k 10 "$limit" $cmd 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  secs=$(( $(date +%s) - start ))
  [ "$rc" -ne 0 ] && failed=1
  summary="$summary\n| $name | $rc | $secs |"
done
echo -e "\n## GPU checks\n$summary" | tee "$LOGS/summary.md"
exit $failed
