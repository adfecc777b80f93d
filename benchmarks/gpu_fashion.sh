#!/usr/bin/env bash
# Fashion-MNIST on one GPU machine (many CPU cores, one GPU): benchmark processes side by side, one per
# (task, group of methods) or (variant, task), each on the GPU with one CPU thread.
#
#     bash benchmarks/gpu_fashion.sh knobs  OUTDIR   # rank1_defaults.py: the knob study, validation split only
#     bash benchmarks/gpu_fashion.sh report OUTDIR   # quality.py: every method, tuned and plain loops, both nets
#     bash benchmarks/gpu_fashion.sh finetune OUTDIR # quality.py: the image fine-tuning tasks (finetune-all), every method
#
# Needs Fashion-MNIST and MNIST (DATA, default ./data; `make data`, or a .gpu_deps/data.tgz of data/ that is
# unpacked to /tmp/data), and bayesian-torch, laplace-torch (with curvlinops-for-pytorch, asdfghjkl,
# backpack-for-pytorch, einops, opt-einsum, linear-operator, unfoldNd, einconv: all pure Python) and corrupt-tta
# importable (or their package folders under .gpu_deps/). Sizes: EPOCHS (20), MAX_TRAIN (all 55000), SEEDS (3), SHIFT (2000 test images for the 15 x 5
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

run_parts() {  # each task x method group ($groups) of "$@" in its own process, side by side; their results in $jsons
  jsons=()
  local task g dir
  for task in "$@"; do
    for g in "${!groups[@]}"; do
      dir="$out/parts/$task-$g"; mkdir -p "$dir"; jsons+=("$dir/quality.json")
      timeout "$limit" "$py" benchmarks/quality.py "${common[@]}" --tasks "$task" --methods ${groups[$g]} --out "$dir" \
        >"$dir/log.txt" 2>&1 &
    done
  done
  wait
}

if [ "$mode" = report ]; then
# report: the shifted test sets first (all 15 corruptions x 5 severities of the first SHIFT test images)
"$py" benchmarks/precompute_shifts.py --split test --data-dir "$data" --cache-dir "$cache" --shift-examples "$shift_n" \
  --workers "$workers" 2>&1 | tail -2
common=(--data-dir "$data" --cache-dir "$cache" --device "$device" --threads 1 --budget "${BUDGET:-2}" --seeds "$seeds"
        --epochs "$epochs" "${train[@]}" "${ood[@]}" --shift-examples "$shift_n")
groups=("deterministic temperature deep-ensemble" "mc-dropout batchensemble" "rank1 rank1-sampled" "rank1-tiled"
        "rank1-cauchy" "bayesian-torch")
run_parts ${TASKS:-fashion-mnist fashion-mnist-plain fashion-mnist-resnet fashion-mnist-resnet-plain}
fi

if [ "$mode" = finetune ]; then
  # the full budget: every pre-training image (MNIST 60000; Fashion-MNIST classes 0-4, 30000) for PRETRAIN_EPOCHS
  # (10), LABELS (2000) fine-tuning labels for FT_EPOCHS (20), the whole test set, all 15 corruptions x 5 of the
  # first SHIFT test images, the whole MNIST test set as OOD. The pre-trained nets are made first (one process per
  # pre-training set) into $out/pretrained, which every process then loads: all start from the same weights.
  # ft-laplace-all (full-network KFAC, GLM predictive) is left out by default: its predictive takes the Jacobians
  # of every parameter a few examples at a time (~30 ms an example on one CPU thread), far over LIMIT at these
  # sizes; add "ft-laplace-all" to FT_GROUPS to run it.
  pre=(--pretrained-dir "$out/pretrained" --pretrain-epochs "${PRETRAIN_EPOCHS:-10}")
  common=(--data-dir "$data" --cache-dir "$cache" --device "$device" --threads 1 --budget "${BUDGET:-2}" --seeds "$seeds"
          --epochs "${FT_EPOCHS:-20}" --max-train "${LABELS:-2000}" "${ood[@]}" --shift-examples "$shift_n" "${pre[@]}")
  for task in fashion-split-finetune mnist-to-fashion-finetune; do
    "$py" benchmarks/precompute_shifts.py --task "$task" --split test --data-dir "$data" --cache-dir "$cache" \
      --shift-examples "$shift_n" --workers "$workers" 2>&1 | tail -1
    "$py" benchmarks/quality.py "${common[@]}" --tasks "$task" --pretrain-only >"$out/pretrain_$task.log" 2>&1 &
  done
  wait
  IFS=';' read -r -a groups <<<"${FT_GROUPS:-ft-deterministic ft-temperature ft-laplace ft-ensemble;ft-mc-dropout ft-batchensemble;ft-rank1 ft-rank1-sampled;ft-rank1-factors ft-rank1-factors-x10}"
  run_parts ${TASKS:-fashion-split-finetune fashion-split-finetune-plain mnist-to-fashion-finetune mnist-to-fashion-finetune-plain}
fi

have=(); for j in "${jsons[@]}"; do [ -s "$j" ] && have+=("$j"); done
echo "parts with results: ${#have[@]} of ${#jsons[@]}"
"$py" benchmarks/quality.py --merge "${have[@]}" --out "$out/merged" && tail -c 3000 "$out/merged/quality.md"
