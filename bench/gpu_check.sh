#!/usr/bin/env bash
# A prepared check for a machine with one NVIDIA H200 (run once, BENCHMARKS.md has its figures).
#
#   bench/gpu_check.sh                 # on the GPU machine: at most 9.5 minutes, no network
#   bench/gpu_check.sh --cpu-dry-run   # here: every part on the CPU with small shapes
#
# Parts (bench/gpu_check.py), each under its own timeout, each ending in PASS, FAIL or SKIP:
#   parity          the GPU's fp32, bf16, bf16+int8, bf16+int4 and bf16+fp8 (8.9+) logits against the fp32
#                   CPU reference (transformers; for int8/int4/fp8 with its weights quantized by the same math)
#   graphs          compile_decode(cuda_graphs=True), bf16 and int8: CUDA-graph replays give the eager logits
#   serve           TorchServe with TP=1 on the GPU answers a request as the model does in-process
#   speed_none, speed_int8, speed_int4, speed_fp8
#                   a random bf16 model of Llama-2-7B's shapes with 8 of its 32 layers, weights as named:
#                   decode tokens/s at batch 1 and 8 against the HBM roofline (weight bytes / 4.8 TB/s),
#                   eager and after compile_decode(cuda_graphs=True) for bf16, with graphs for int8
#                   (against bf16's), eager for int4 and fp8
#   attention       that model in bf16 at batch 1 and 8, contexts of 4k and 16k tokens: a decode step
#                   with flex (FlexAttention in place) and with sdpa (gather), and their logits
# Environment: PY (the Python; default python3, or .venv/bin/python for the dry run), WHEELS (a
# folder of wheels; when it exists, the requirements but torch are installed from it first, with
# pip --no-index: the machine's own CUDA torch stays), LOG_DIR (where each part's log goes;
# default $OUT when set, else /tmp/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=""
if [ "${1:-}" = "--cpu-dry-run" ]; then DRY="--cpu-dry-run"; fi
if [ -z "${PY:-}" ]; then
  if [ -n "$DRY" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
LOG_DIR=${LOG_DIR:-${OUT:-/tmp/gpu_check}}
WHEELS=${WHEELS:-wheels}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
START=$SECONDS

if [ -d "$WHEELS" ]; then
  grep -v '^torch==' requirements.txt > "$LOG_DIR/requirements-no-torch.txt"
  timeout 60 "$PY" -m pip install -q --no-index --find-links "$WHEELS" -r "$LOG_DIR/requirements-no-torch.txt" \
    || echo "pip install from $WHEELS failed: the parts that need the missing packages will say so"
fi
if [ -z "$DRY" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")'

declare -A RESULT
# The dry run compiles the same graphs with inductor's C++ backend on a few CPU cores: 6 times the time.
SCALE=1
if [ -n "$DRY" ]; then SCALE=6; fi
part() {  # part NAME SECONDS ARGS...: run one part, keep its log and its last word
  local name=$1 limit=$(($2 * SCALE))
  shift 2
  echo "=== $name (at most ${limit} s)"
  timeout "$limit" "$PY" bench/gpu_check.py "$@" $DRY 2>&1 | tee "$LOG_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  local last
  last=$(tail -n 1 "$LOG_DIR/$name.log")
  if [ "$rc" = 124 ]; then RESULT[$name]="FAIL (timed out after $limit s)"
  elif [[ "$last" == SKIP* ]]; then RESULT[$name]="$last"
  elif [ "$rc" = 0 ] && [ "$last" = PASS ]; then RESULT[$name]=PASS
  else RESULT[$name]="FAIL (exit $rc)"; fi
}

# Limits from the H200 run of 2026-11-30 (BENCHMARKS.md): compile_decode took 44 s, and
# compile_decode(cuda_graphs=True), with its buckets captured, 61-85 s. To stay within 9.5
# minutes with the wheels' install (60 s), under a device call's 10, the speed parts measure
# bf16 eager and with graphs, int8 with graphs (what it must beat bf16 by), int4 and fp8
# eager (`gpu_check.py speed --quant int4 --modes graphs` times the others, about 2 minutes
# each). The limits of the parts added since that run (speed_fp8, attention) are guesses.
part parity 45 parity
part graphs 110 graphs
part serve 30 serve
part speed_none 110 speed --quant none --modes eager graphs
part speed_int8 90 speed --quant int8 --modes graphs
part speed_int4 40 speed --quant int4 --modes eager
part speed_fp8 40 speed --quant fp8 --modes eager
part attention 45 attention

echo "=== summary ($((SECONDS - START)) s; logs in $LOG_DIR)"
status=0
for name in parity graphs serve speed_none speed_int8 speed_int4 speed_fp8 attention; do
  echo "$name: ${RESULT[$name]}"
  [[ "${RESULT[$name]}" == FAIL* ]] && status=1
done
exit $status
