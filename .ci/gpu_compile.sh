#!/usr/bin/env bash
# CI: the deviceless GPU compile check (issue 50): every Pallas kernel compiled for an H100
# (sm_90a) on this CPU-only machine, ptxas -v on its PTX (registers, spills), XLA's launch
# (shared memory, grid). A venv of its own: the CUDA wheels stay out of the main interpreter.
# JAXKV_GPU_COMPILE_TABLE=path (inherited) also writes the cases' Markdown table there.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
jax_version=0.10.2        # the Triton path the check compiles changes after jax 0.10.2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
venv="$tmp/cuda"

echo "== deviceless GPU compile check: $(python3 --version), jax $jax_version =="
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q -e . "jax==$jax_version" "jaxlib==$jax_version" \
    "jax-cuda12-plugin==$jax_version" "jax-cuda12-pjrt==$jax_version" \
    "nvidia-cuda-nvcc-cu12==12.9.86" pytest
echo "venv ready in $((SECONDS - start)) s"
JAX_PLATFORMS=cpu "$venv/bin/python" -m pytest -q -m gpu_compile tests/test_gpu_compile.py
echo "gpu_compile: $((SECONDS - start)) s in all"
