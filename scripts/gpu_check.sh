#!/usr/bin/env bash
# Every gpu-marked test, a short GPU benchmark and a short GPU sweep, in under 5 minutes
# on one GPU. Run on a machine with CUDA:  bash scripts/gpu_check.sh
# Writes what it measured under ${OUT:-gpu_check_out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
# --no-build-isolation: a GPU machine without network builds with its own setuptools. Packages
# its image lacks can come from a folder of wheels (PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR).
python3 -m pip install -q --no-build-isolation -e ".[dev]" 2>&1 | tail -n 2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
status=0
echo "== gpu-marked tests"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt" || status=1
echo "== GPU benchmarks (paged vs contiguous decode attention, achieved HBM bandwidth)"
timeout 90 python3 -m pytest -q tests/benchmarks -m gpu -o python_files='bench_*.py' --benchmark-only \
  --benchmark-json="$out/gpu_bench.json" -s 2>&1 | tee "$out/gpu_bench.txt" || status=1
echo "== short GPU sweep"
timeout 90 kvbench sweep +experiment=gqa_vs_mha run.device=cuda run.dtype=bf16 engine=paged \
  run.results_dir="$out/results" run.progress=off 2>&1 | tee "$out/gpu_sweep.txt" || status=1
exit $status
