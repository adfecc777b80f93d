#!/usr/bin/env bash
# Fashion-MNIST on one GPU machine (many CPU cores, one GPU): benchmark processes side by side, one per
# (task, group of methods) or (variant, task), each on the GPU with one CPU thread.
#
#     bash benchmarks/gpu_fashion.sh knobs  OUTDIR   # rank1_defaults.py: the knob study, validation split only
#     bash benchmarks/gpu_fashion.sh report OUTDIR   # quality.py: every method, tuned and plain loops, both nets
#
# Needs Fashion-MNIST and MNIST (DATA, default ./data; `make data`, or a .gpu_deps/data.tgz of data/ that is
# unpacked to /tmp/data), and bayesian-torch and corrupt-tta importable (or their package folders under
# .gpu_deps/). Sizes: EPOCHS (20), MAX_TRAIN (all 55000), SEEDS (3), SHIFT (2000 test images for the 15 x 5
# shifted sets), LIMIT (seconds per process), MAX_OOD, DEVICE (cuda; cpu for a smoke test of this script). The shifted sets are made first by precompute_shifts.py
# on all cores. Each process writes its own report; `quality.py --merge` joins them into one.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?knobs or report}; out=${2:?output folder}
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
data="${DATA:-data}"
if [ ! -e "$data/FashionMNIST" ] && [ -e .gpu_deps/data.tgz ]; then
  mkdir -p /tmp/data && tar xzf .gpu_deps/data.tgz -C /tmp/data && data=/tmp/data
fi
cache="${CACHE:-/tmp/qcache}"
epochs="${EPOCHS:-20}"; seeds="${SEEDS:-3}"; shift_n="${SHIFT:-2000}"; limit="${LIMIT:-500}"
train=(); [ -n "${MAX_TRAIN:-}" ] && train=(--max-train "$MAX_TRAIN")
workers=$(nproc); device="${DEVICE:-cuda}"
ood=(); [ -n "${MAX_OOD:-}" ] && ood=(--max-ood "$MAX_OOD")
"$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee "$out/machine.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$out/machine.txt" 2>/dev/null
nproc >>"$out/machine.txt"

if [ "$mode" = knobs ]; then
  # validation split only: rank1_defaults.py's shifted sets are made of the first VAL_SHIFT validation images
  val_shift="${VAL_SHIFT:-1000}"
  "$py" benchmarks/precompute_shifts.py --split val --data-dir "$data" --cache-dir "$HOME/.cache/bayesify/quality" \
    --shift-examples "$val_shift" --workers "$workers" 2>&1 | tail -2
  common=(--data-dir "$data" --device "$device" --threads 1 --epochs "$epochs" "${train[@]}" --shift-examples "$val_shift" --seeds "$seeds")
  defines=(
    --define r1-sampled '{"eval_noise": true}'
    --define r1-p0.1 '{"convert": {"prior_std": 0.1}}'
    --define r1-p0.3 '{"convert": {"prior_std": 0.3}}'
    --define r1-p0.3-sampled '{"convert": {"prior_std": 0.3}, "eval_noise": true}'
    --define r1-kl0.1 '{"kl_scale": 0.1}'
    --define r1-warm0.1 '{"kl_warmup": 0.1}'
    --define r1-tile '{"route": "tile"}'
  )
  for task in ${KNOB_TASKS:-fashion-mnist-plain fashion-mnist-resnet-plain}; do
    lr=1e-3; case $task in *-plain) ;; *) lr=2e-3 ;; esac
    for variant in ${VARIANTS:-deterministic mc-dropout rank1 r1-sampled r1-p0.1 r1-p0.3 r1-p0.3-sampled r1-kl0.1 r1-warm0.1 r1-tile}; do
      timeout "$limit" "$py" benchmarks/rank1_defaults.py "${common[@]}" "${defines[@]}" --lr "$lr" --tasks "$task" \
        --variants "$variant" --log "$out/knobs_${task}_${variant}.jsonl" >"$out/knobs_${task}_${variant}.log" 2>&1 &
    done
  done
  wait
  cat "$out"/knobs_*.jsonl >"$out/knobs.jsonl" 2>/dev/null
  "$py" benchmarks/rank1_defaults.py --summary --log "$out/knobs.jsonl" --tasks ${KNOB_TASKS:-fashion-mnist-plain fashion-mnist-resnet-plain} | tee "$out/knobs.md"
  exit 0
fi

# report: the shifted test sets first (all 15 corruptions x 5 severities of the first SHIFT test images)
"$py" benchmarks/precompute_shifts.py --split test --data-dir "$data" --cache-dir "$cache" --shift-examples "$shift_n" \
  --workers "$workers" 2>&1 | tail -2
common=(--data-dir "$data" --cache-dir "$cache" --device "$device" --threads 1 --budget "${BUDGET:-2}" --seeds "$seeds"
        --epochs "$epochs" "${train[@]}" "${ood[@]}" --shift-examples "$shift_n")
groups=("deterministic temperature deep-ensemble" "mc-dropout batchensemble" "rank1 rank1-sampled" "rank1-tiled"
        "rank1-cauchy" "bayesian-torch")
jsons=()
for task in ${TASKS:-fashion-mnist fashion-mnist-plain fashion-mnist-resnet fashion-mnist-resnet-plain}; do
  for g in "${!groups[@]}"; do
    dir="$out/parts/$task-$g"; mkdir -p "$dir"; jsons+=("$dir/quality.json")
    timeout "$limit" "$py" benchmarks/quality.py "${common[@]}" --tasks "$task" --methods ${groups[$g]} --out "$dir" \
      >"$dir/log.txt" 2>&1 &
  done
done
wait
have=(); for j in "${jsons[@]}"; do [ -s "$j" ] && have+=("$j"); done
echo "parts with results: ${#have[@]} of ${#jsons[@]}"
"$py" benchmarks/quality.py --merge "${have[@]}" --out "$out/merged" && tail -c 3000 "$out/merged/quality.md"
