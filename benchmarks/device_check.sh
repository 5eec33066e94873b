#!/usr/bin/env bash
# The prepared runs for a session lent a GPU (issues 21, 37), in two stages that each fit one call of a 15-minute
# lease (a machine's start costs 1-2 minutes of it, and no machine starts with under 4 minutes left):
#   first   (~8 min) the kernel probe first (benchmarks/probe_kernels.py, under 5 minutes with its builds: GPU-only
#           time from CUDA graphs beside the host-inclusive time, bytes/s against a streaming ceiling, SDPA and
#           every variant at 197...16385 tokens and batch 256 x 197, ELU's launch settings, each mixer's top
#           kernels), then the kernels against the eager forms (parity: a wrong kernel fails the run), the
#           op-level rows, and speed and memory at 224 and 1024 px against SDPA softmax. (Registers and spills
#           are a CPU cross-build: benchmarks/kernel_resources.py --arch sm_90, not a GPU step.)
#   second  (~4.5 min) where the time goes: whole-model profiles at 224 px (inference) and 1024 px (training),
#           one layer at 4097 tokens, the host's time per layer; then speed at 2048 px, bf16 against fp32, the
#           distill trainer stopped and resumed, and the compiled rows as far as their budget goes;
#   all     both, one after the other (~9 min: a longer lease).
# Each stage's results are under $OUT, written as they come (a stage stopped at its limit keeps what it found);
# machine.txt says what ran, for how long and how it ended. The GPU image has torch, triton, timm, rich,
# safetensors, typer and huggingface_hub (nothing to carry).
# Usage (from the repository root): OUT=/some/folder bash benchmarks/device_check.sh first|second|all
set -uo pipefail
stage=${1:-first}
case $stage in first|second|all) ;; *) echo "error: stage '$stage': give first, second or all" >&2; exit 2;; esac
OUT=${OUT:-benchmarks/results/device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  date -u
  echo "stage $stage"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton, timm; print('torch', torch.__version__, 'triton', triton.__version__, 'timm', timm.__version__)"
  git rev-parse HEAD 2>/dev/null
} >> "$OUT/machine.txt" 2>&1
python -c "import vitconvert, rich, safetensors" 2>> "$OUT/machine.txt" || { echo "missing packages: see $OUT/machine.txt"; exit 2; }
run() {  # run NAME SECONDS COMMAND...: its output in $OUT/NAME.txt, and a line saying how it ended
  local name=$1 limit=$2; shift 2
  local began=$SECONDS
  echo "$name: running (at most $limit s), output in $OUT/$name.txt"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: exit $? in $((SECONDS - began)) s" | tee -a "$OUT/machine.txt"
}
if [[ $stage == first || $stage == all ]]; then
  run probe-kernels 290 python benchmarks/probe_kernels.py --budget-s 200 --out "$OUT/probe-kernels.jsonl"
  run gpu-check-first 200 python benchmarks/gpu_check.py --sections parity,op,speed --sizes 224,1024 --budget-s 130 \
    --out "$OUT/gpu-check-first.json"
fi
if [[ $stage == second || $stage == all ]]; then
  run profile-224-infer 50 python benchmarks/profile_model.py --img-size 224 --batch 256 --variants softmax,elu,mhla,ttt
  run profile-1024-train 50 python benchmarks/profile_model.py --img-size 1024 --batch 16 --train --variants softmax,elu,mhla,ttt
  run mix-4097 35 python benchmarks/profile_mix.py --tokens 4097 --variants softmax,elu,mhla,ttt
  run host-overhead 25 python benchmarks/host_overhead.py --json "$OUT/host-overhead.json"
  run gpu-check-second 110 python benchmarks/gpu_check.py --sections speed,precision,distill,compiled --sizes 2048 \
    --budget-s 60 --out "$OUT/gpu-check-second.json"
fi
