#!/usr/bin/env bash
# The GPU check in one command: tests/test_cuda.py, then every GPU row of benchmarks/overhead.py (ResNet-50 and
# ViT-B/16 at B=128, GPT-2 small at 16x256, bf16 autocast, eager with the peers, a torch.profiler kernel table of the
# ResNet-50 step, then compiled), each table as
# markdown. Whoever has a GPU runs it as it is:
#
#     bash benchmarks/gpu.sh                 # on a CUDA machine; writes to ${OUT:-benchmarks/results/gpu}
#     bash benchmarks/gpu.sh --smoke         # the same steps on the CPU with tiny models (checks the script; ${OUT:-/tmp/bayesify-gpu-smoke})
#
# Each step has its own time limit (STEP_LIMIT, TEST_LIMIT seconds) and writes its table as soon as it ends, so a
# run cut short keeps what it measured; COMPILE_MODELS / COMPILE_GPT2=1 choose the compiled rows (each compile
# takes a minute or more); KERNEL_ROWS=0 leaves out the rows with the fused kernels. bayesian-torch (the mean-field peer) is pure Python: where it is not installed, a copy of its package
# directory put under .gpu_deps/ is used (PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
# the smoke run checks the script: its tables go to a scratch folder, never over the GPU's committed ones
if [ "${1:-}" = "--smoke" ]; then out="${OUT:-${TMPDIR:-/tmp}/bayesify-gpu-smoke}"; else out="${OUT:-benchmarks/results/gpu}"; fi
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python}"

if [ "${1:-}" = "--smoke" ]; then
  device=(--device cpu --threads 2); models_eager="resnet18:32,vit_tiny_patch16_224:32,gpt2-tiny:16"; batch=4; repeats=1
  tests=(env BAYESIFY_TEST_DEVICE=cpu "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "identity and resnet18" -x)
  compile_models="resnet18:32"; step_limit=300
else
  device=(--device cuda --amp bf16); models_eager=""; batch=128; repeats="${REPEATS:-7}"
  tests=("$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py --durations=8)
  compile_models="${COMPILE_MODELS:-resnet50:224}"; step_limit="${STEP_LIMIT:-150}"
fi

{ "$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true; } | tee "$out/machine.txt"

echo "== tests/test_cuda.py"
timeout "${TEST_LIMIT:-150}" "${tests[@]}" 2>&1 | tail -25 | tee "$out/test_cuda.txt"

run() {  # name, extra overhead.py args...
  local name=$1; shift
  echo "== $name"
  timeout "$step_limit" "$py" benchmarks/overhead.py --no-recurrent "${device[@]}" "$@" 2>&1 | tee "$out/$name.md" | grep -v '^\s*$' | tail -12
}

if [ "${1:-}" = "--smoke" ]; then
  run eager --models "$models_eager" --batch "$batch" --repeats "$repeats" --peers
  run compiled --models "$compile_models" --batch "$batch" --repeats "$repeats" --compile --default-route-only
  run profile --models resnet18:32 --batch "$batch" --repeats 1 --default-route-only --profile
else
  run eager-resnet50-vit --models resnet50:224,vit_base_patch16_224:224 --batch 128 --repeats "$repeats" --peers
  run eager-gpt2 --models gpt2:256 --batch 16 --repeats "$repeats" --peers
  # the same default-route rows with the per-row scalings as the fused Triton kernels (bayesify/kernels, off by
  # default: on an H200 they made GPT-2's step slower), and with the backward kernels only, to read what they bring;
  # KERNEL_ROWS=0 leaves them out
  if [ "${KERNEL_ROWS:-1}" != 0 ]; then
    BAYESIFY_KERNELS=1 run eager-kernels-resnet50 --models resnet50:224 --batch 128 --repeats "$repeats" --default-route-only
    BAYESIFY_KERNELS=1 run eager-kernels-gpt2 --models gpt2:256 --batch 16 --repeats "$repeats" --default-route-only
    BAYESIFY_KERNELS=backward run eager-backward-kernels-gpt2 --models gpt2:256 --batch 16 --repeats "$repeats" --default-route-only
  fi
  # where the rank-1 step's extra GPU time goes: torch.profiler's kernel table, deterministic vs rank-1 (eager)
  run profile-resnet50 --models resnet50:224 --batch 128 --repeats 3 --default-route-only --profile
  run compiled --models "$compile_models" --batch 128 --repeats 5 --compile --default-route-only --peers
  [ -n "${COMPILE_GPT2:-}" ] && run compiled-gpt2 --models gpt2:256 --batch 16 --repeats 5 --compile --default-route-only
fi
echo "== tables in $out"
