#!/usr/bin/env bash
# The prepared command for a lent GPU (about 15 minutes of device time in all): every GPU
# measurement of hybridpar in two phases, each part under its own time limit, logs in $OUT.
#
#   bash benchmarks/gpu_session.sh 1   # multi-rank CUDA layouts beside the feature smoke, then the
#                                      # step vs plain PyTorch (0.7B), CLI MFU + planner (1B),
#                                      # the profile, FP8 vs bf16 vs torchao at the 3B shape
#   bash benchmarks/gpu_session.sh 2   # FP8 vs bf16 vs torchao at the 1B shape, and 200-step losses
#
# torchao travels as a wheel in .whl/ (see docs: carried with the call); without it the FP8 rows
# run ours alone. Rehearse on CPU first: `GPU_SESSION_DEVICE=cpu bash benchmarks/gpu_session.sh 1`.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hybridpar-gpu-session}
mkdir -p "$OUT"
DEV=${GPU_SESSION_DEVICE:-cuda}
QUICK=$([ "$DEV" = cpu ] && echo --quick || true)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
END=$((SECONDS + ${GPU_SESSION_SECONDS:-570}))

# at most $1 seconds, and never past the phase's end
limit() { local left=$((END - SECONDS)); echo $(($1 < left ? $1 : (left > 5 ? left : 5))); }

setup() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1 || true
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    if ls .whl/*.whl >/dev/null 2>&1; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
      export PYTHONPATH="$PYTHONPATH:/tmp/site"
      if ! "$PY" -c "import torchao.float8" 2>&1 && ls .whl/alt/*.whl >/dev/null 2>&1; then
        rm -rf /tmp/site
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/alt/*.whl
      fi
      "$PY" -c "import torchao, torchao.float8; print('torchao', torchao.__version__)" 2>&1 | tail -2
    fi; } > "$OUT/setup.log" 2>&1
  if [ -d /tmp/site ]; then export PYTHONPATH="$PYTHONPATH:/tmp/site"; fi
  cat "$OUT/setup.log"
}

part() {  # part NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, show its table
  local name=$1 cap; cap=$(limit "$2"); shift 2
  echo "== $name (limit ${cap}s, $((END - SECONDS))s left in the phase)"
  local start=$SECONDS
  timeout "$cap" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v '^{"benchmark"' "$OUT/$name.log" | grep -E '^(device|  )' | tail -40
  echo "== $name: exit $rc after $((SECONDS - start))s"
}

setup
case "${1:-1}" in
  1)
    part multirank 240 "$PY" benchmarks/gpu_multirank.py --device "$DEV" --jobs 5 &
    part smoke 200 "$PY" benchmarks/gpu.py --device "$DEV" $QUICK --parts smoke
    wait
    part overhead 200 "$PY" benchmarks/gpu.py --device "$DEV" $QUICK --parts overhead --steps 8
    part cli 150 "$PY" benchmarks/gpu.py --device "$DEV" $QUICK --parts cli_mfu,profile
    part fp8_3b 400 "$PY" benchmarks/gpu_fp8.py --device "$DEV" $QUICK --shapes 3b --steps 10 \
      --loops ours/none,ours/tensorwise,ours/rowwise,torchao/tensorwise
    ;;
  2)
    part fp8_1b 400 "$PY" benchmarks/gpu_fp8.py --device "$DEV" $QUICK --loss-steps 200 --shapes 1b --steps 10 \
      --loops torchao/none,torchao/rowwise,ours/none,ours/tensorwise,ours/rowwise,torchao/tensorwise
    ;;
esac
