#!/usr/bin/env bash
# The one prepared run for a session lent a GPU (issue 21), about 8 minutes on one H200; results under $OUT:
#   1. where the time goes: whole-model profiles at 224 px (inference) and 1024 px (training), softmax in the
#      same run, then the token mixing alone at 4097 tokens;
#   2. the host's time per layer at a tiny size (where the GPU waits for Python: launches, dispatch), and the
#      registers, spills and shared memory of every fused kernel as Triton builds it (TTT's are the heaviest);
#   3. benchmarks/gpu_check.py: the kernels against the eager forms (parity: a wrong kernel fails the run), the
#      op-level section, speed and memory against SDPA softmax, precision, distill,
#      compiled rows (as far as its budget goes), saved section by section.
# Usage (from the repository root): OUT=/some/folder bash benchmarks/device_check.sh
set -uo pipefail
OUT=${OUT:-benchmarks/results/device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton, timm; print('torch', torch.__version__, 'triton', triton.__version__, 'timm', timm.__version__)"
  git rev-parse HEAD 2>/dev/null
} > "$OUT/machine.txt" 2>&1
python -c "import vitconvert, rich, safetensors" 2>> "$OUT/machine.txt" || { echo "missing packages: see $OUT/machine.txt"; exit 2; }
run() {  # run NAME SECONDS COMMAND...: its output in $OUT/NAME.txt, and a line saying how it ended
  local name=$1 limit=$2; shift 2
  local began=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: exit $? in $((SECONDS - began)) s" | tee -a "$OUT/machine.txt"
}
run profile-224-infer 90 python benchmarks/profile_model.py --img-size 224 --batch 256 --variants softmax,elu,mhla,ttt
run profile-1024-train 90 python benchmarks/profile_model.py --img-size 1024 --batch 16 --train --variants softmax,elu,mhla,ttt
run mix-4097 60 python benchmarks/profile_mix.py --tokens 4097 --variants softmax,elu,mhla,ttt
run host-overhead 40 python benchmarks/host_overhead.py --json "$OUT/host-overhead.json"
run kernel-resources 25 python benchmarks/kernel_resources.py --json "$OUT/kernel-resources.json"
run gpu-check 250 python benchmarks/gpu_check.py --budget-s 185 --out "$OUT/gpu-check-cuda.json"
