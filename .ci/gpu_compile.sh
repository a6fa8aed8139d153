#!/usr/bin/env bash
# CI: the deviceless GPU compile check (issue 50): every Pallas kernel compiled for an H100
# (sm_90a) on this CPU-only machine, ptxas -v on its PTX (registers, spills), XLA's launch
# (shared memory, grid). Twice, each in a venv of its own (the CUDA wheels stay out of the main
# interpreter): jax 0.10.2 on python3 (3.11; pyproject's cuda12 extra) and jax 0.12.0.1 on Python
# 3.12, the newest set with a CUDA plugin (jax 0.12.1 has none); the Triton that jax ships, hence
# the PTX, differs between them (docs/gpu.md "Newer JAX"). A spill, a shared-memory overflow or
# registers past a case's budget on either fails the leg. The two checks run side by side.
# tests/test_gpu_check.py's gpu_compile test: bench/gpu_check.py --prepare archives a cubin.
# JAXKV_GPU_COMPILE_TABLE=path.md (inherited) also writes each version's Markdown table to
# path.jax<version>.md.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT   # a check still running
NVCC=12.9.86                      # ptxas
VERSIONS=(0.10.2 0.12.0.1)        # tests/test_gpu_compile.py's REGISTER_JAX

make_venv() {   # version, python command...
    local version=$1; shift
    "$@" -m venv "$tmp/jax$version"
    # no bytecode compile of every installed module (half the install): a check imports few
    "$tmp/jax$version/bin/python" -m pip install -q --no-compile -e . "jax==$version" \
        "jaxlib==$version" "jax-cuda12-plugin==$version" "jax-cuda12-pjrt==$version" \
        "nvidia-cuda-nvcc-cu12==$NVCC" pytest
    echo "venv jax $version ($("$tmp/jax$version/bin/python" --version)): ready at" \
         "$((SECONDS - start)) s"
}

check() {       # version: the check in its venv, its output to $tmp/jax<version>.log
    local version=$1 rc=0 begin=$SECONDS
    local envs=(JAX_PLATFORMS=cpu)
    if [[ -n "${JAXKV_GPU_COMPILE_TABLE:-}" ]]; then
        envs+=("JAXKV_GPU_COMPILE_TABLE=${JAXKV_GPU_COMPILE_TABLE%.md}.jax$version.md")
    fi
    env "${envs[@]}" "$tmp/jax$version/bin/python" -m pytest -q -p no:cacheprovider \
        -m gpu_compile tests/test_gpu_compile.py tests/test_gpu_check.py \
        > "$tmp/jax$version.log" 2>&1 || rc=$?
    echo "gpu_compile, jax $version: exit $rc in $((SECONDS - begin)) s" >> "$tmp/jax$version.log"
    return $rc
}

echo "== deviceless GPU compile check: jax ${VERSIONS[*]} =="
# the longer check (0.12.0.1) starts first; the other venv is built while it runs (each venv maps
# jaxkv to this checkout by an import finder: a second install does not disturb a running check)
PYENV_VERSION=3.12.1 make_venv 0.12.0.1 python3.12
check 0.12.0.1 &
pid_new=$!
make_venv 0.10.2 python3
check 0.10.2 &
pid_old=$!

status=0
for version in 0.10.2 0.12.0.1; do
    rc=0
    if [[ $version == 0.10.2 ]]; then wait $pid_old || rc=$?; else wait $pid_new || rc=$?; fi
    echo "== jax $version =="
    cat "$tmp/jax$version.log"
    if (( rc != 0 )); then status=1; fi
done
echo "gpu_compile: $((SECONDS - start)) s in all"
exit $status
