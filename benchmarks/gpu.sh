#!/usr/bin/env bash
# The GPU check in one command, sized for 15 minutes of one GPU (machine start included): tests/test_cuda.py, then
# benchmarks/overhead.py's GPU rows (bf16 autocast, K=4): eager ResNet-50 and ViT-B/16 at B=128 and GPT-2 small at
# 16x256 with the peers (BatchEnsemble, bayesian-torch) and a torch.profiler kernel table of the ResNet-50 step; then
# compiled ResNet-18 at 224 px, B=128 (training step and mixture evaluation, with the compiled steps' kernel table) and
# GPT-2 small (training step). Each table as markdown. Whoever has a GPU runs it as it is:
#
#     bash benchmarks/gpu.sh                 # on a CUDA machine; writes to ${OUT:-benchmarks/results/gpu}
#     bash benchmarks/gpu.sh --smoke         # the same steps on the CPU with tiny models (checks the script; ${OUT:-/tmp/bayesify-gpu-smoke})
#
# Each step has its own time limit (STEP_LIMIT, TEST_LIMIT seconds; TOTAL_LIMIT for the whole) and writes its table as soon as it ends, so a
# run cut short keeps what it measured; COMPILED_CNN=resnet50:224 compiles the larger CNN (two minutes or more per
# step); KERNEL_ROWS=1 adds a GPT-2 row with the fused Triton kernels. bayesian-torch (the mean-field peer) is pure
# Python: where it is not installed, a copy of its package directory put under .gpu_deps/ is used (PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
# the smoke run checks the script: its tables go to a scratch folder, never over the GPU's committed ones
if [ "${1:-}" = "--smoke" ]; then out="${OUT:-${TMPDIR:-/tmp}/bayesify-gpu-smoke}"; else out="${OUT:-benchmarks/results/gpu}"; fi
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python}"

if [ "${1:-}" = "--smoke" ]; then
  device=(--device cpu --threads 2); big="resnet18:32,vit_tiny_patch16_224:32"; lm="gpt2-tiny:16"; lm_batch=4; batch=4
  repeats=1; compiled_cnn="resnet18:32"; compiled_batch=4; step_limit=300
  tests=(env BAYESIFY_TEST_DEVICE=cpu "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "identity and resnet18" -x)
else
  device=(--device cuda --amp bf16); big="resnet50:224,vit_base_patch16_224:224"; lm="gpt2:256"; lm_batch=16; batch=128
  repeats="${REPEATS:-7}"; compiled_cnn="${COMPILED_CNN:-resnet18:224}"; compiled_batch=128; step_limit="${STEP_LIMIT:-150}"
  # the tests are independent: spread over processes (one GPU), the file runs in about a minute
  tests=("$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py -n "${TEST_WORKERS:-6}" --durations=8)
fi

{ "$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true; } | tee "$out/machine.txt"

echo "== tests/test_cuda.py"
timeout "${TEST_LIMIT:-150}" "${tests[@]}" 2>&1 | tail -25 | tee "$out/test_cuda.txt"

deadline=$((SECONDS + ${TOTAL_LIMIT:-100000}))  # TOTAL_LIMIT: seconds for the whole script; each step gets what is left
run() {  # name, extra overhead.py args...
  local name=$1 limit=$((deadline - SECONDS)); shift
  [ "$limit" -gt "$step_limit" ] && limit=$step_limit
  [ "$limit" -lt 20 ] && { echo "== $name: skipped (TOTAL_LIMIT reached)"; return; }
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$py" benchmarks/overhead.py --no-recurrent "${device[@]}" "$@" 2>&1 | tee "$out/$name.md" | grep -v '^\s*$' | tail -12
}

# eager, with the peers (BatchEnsemble, bayesian-torch) and a torch.profiler table of the first model's steps
run eager-cnn-vit --models "$big" --batch "$batch" --repeats "$repeats" --rows sample,mixture --peers --profile
# compiled (each step compiles once, inductor's caches off: a minute or more per ResNet-50 step on an H200, so the
# default CNN here is ResNet-18 at 224 px; COMPILED_CNN=resnet50:224 for the larger one), with the kernel table of
# the compiled steps (inductor's generated kernels)
run compiled-cnn --models "$compiled_cnn" --batch "$compiled_batch" --repeats 5 --rows sample,mixture --compile --profile
run eager-gpt2 --models "$lm" --batch "$lm_batch" --repeats "$repeats" --rows sample,mixture --peers
run compiled-gpt2 --models "$lm" --batch "$lm_batch" --repeats 5 --rows sample --compile
# the per-row scalings as the fused Triton kernels (bayesify/kernels, off by default: on an H200 they made GPT-2's
# step slower): KERNEL_ROWS=1 adds them
if [ "${KERNEL_ROWS:-0}" = 1 ] && [ "${1:-}" != "--smoke" ]; then
  BAYESIFY_KERNELS=1 run eager-kernels-gpt2 --models gpt2:256 --batch 16 --repeats "$repeats" --default-route-only
fi
echo "== tables in $out"
