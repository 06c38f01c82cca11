#!/bin/bash
# The CUDA checks of the open issues in one call on a lent GPU machine (../shared/gpu/README.md),
# each under its own time limit so the whole fits one 10-minute command; logs land in $OUT.
#   here:  bash ../shared/gpu/build_ort_gpu.sh .ortgpu       (ignored by git; carry it: ".ortgpu")
#   there: bash tools/gpu_checks.sh .ortgpu [suite,train,graph,convert]
set -uo pipefail
payload=${1:?PAYLOAD_DIR holding ort.tar.xz}
wanted=${2:-suite,train,graph,convert}
out=${OUT:-/tmp/gpu-checks}
mkdir -p "$out"
# shellcheck disable=SC1091
for setup in ../shared/gpu/setup_on_gpu.sh shared/gpu/setup_on_gpu.sh; do
  [[ -f $setup ]] && { . "$setup" "$payload" || exit 1; break; }
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"

run() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  [[ ",$wanted," == *",$name,"* ]] || return 0
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "$name: rc $? in $((SECONDS - start)) s (limit $limit)" | tee -a "$out/summary.txt"
  tail -n 25 "$out/$name.log"
}

# issue 37: the suite green where CUDA loads (tests expect what the provider that loads does)
run suite 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests
# issue 38: the step beside torch on the GPU, then captured as a CUDA graph
run train 150 python3 tools/bench_train.py --device cuda --models mlp,cnn,bert --threads 0 --rounds 10 \
  --contenders torch,torch-bf16,trainer,trainer-fp16
run graph 90 python3 tools/bench_train.py --device cuda --cuda-graph --models mlp,bert --threads 0 --rounds 10 \
  --contenders torch,trainer,trainer-fp16
# issue 40: size, casts and time of each converter's float16/bfloat16 model
run convert 120 python3 tools/bench_gpu.py --models bert,resnet50
cat "$out/summary.txt"
