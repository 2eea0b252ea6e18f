#!/usr/bin/env bash
# The GPU check, for a machine with CUDA: the CUDA tests, then the benchmark at GPU sizes.
# Run from the repository root, in an environment with nandoctor installed (pip install -e ".[dev]").
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# About 10 minutes on one GPU; it ends by printing, per workload, each candidate's step time
# over the plain loop's and the blocking device synchronisations per step.
set -euo pipefail
out="${1:-gpu-results}"
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
# 1. the CUDA tests (skipped on the CPU; the rest of the suite is CI's), among them the
# CPU emulation of CUDA's autocast against CUDA's own, op by op and per example
python -m pytest -q -m cuda 2>&1 | tee "$out/tests.txt"
python -m benchmarks.autocast_policy --width 256 2>&1 | tee "$out/autocast-policy.txt"
# 2. diagnose the shipped examples on the GPU (CUDA autocast differs from the CPU's)
for config in configs/seed-fp16-nan.yaml configs/fp16-overflow.yaml configs/exploding-gradients.yaml; do
    python -m nandoctor diagnose "$config" --device cuda --no-verify --json "$out/$(basename "$config" .yaml).json" -q || true
done
# 3. the benchmark at GPU sizes, with device syncs counted by torch's sync debug mode (the
# start-up figure is the CPU page's: launching processes says nothing of the GPU)
python -m benchmarks --size gpu --device cuda --rounds 5 --steps 20 --step-budget 20 \
    --failing-step 300 --verified-milestone 1000 --verified-pairs 1 --start-up-repeats 0 \
    --process-pairs 2 --process-seconds 5 \
    --out "$out/performance-gpu.md" --json "$out/performance-gpu.json"
# 4. the answer in one screen: the targets, then the synchronisations per step
sed -n '/^## Targets/,/^## Step time/p' "$out/performance-gpu.md" | head -n -1
sed -n '/^## Host reads per step/,/^## Time to diagnosis/p' "$out/performance-gpu.md" | head -n -1
