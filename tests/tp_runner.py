"""Helpers of the multi-device tests: launch tests/tp_worker.py with N fake CPU devices.

The device-count flag must be set before jax is imported, so each check runs in a subprocess
with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``; the worker prints its results as
one JSON line, which ``run_worker`` returns.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tiny_models import save_tiny_model, save_tokenizer

WORKER = Path(__file__).with_name("tp_worker.py")
REPO = WORKER.parents[1]
# head counts that divide 8; llama's 2 kv heads are repeated at TP 4 and 8, qwen2 has biases.
# hidden 128 gives head_dim 16, the smallest the Pallas kernels take.
TINY = {"llama": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2),
        "qwen2": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4),
        # experts split over tp along their SwiGLU width, the router replicated
        "mixtral": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2),
        # a hybrid cache (sliding window 8, full) with learned sinks split over the heads
        "gpt_oss": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=16, intermediate_size=64, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=8)}


def worker_env(devices: int) -> dict:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}


def worker_cmd(*args) -> list[str]:
    return [sys.executable, str(WORKER), *map(str, args)]


def run_worker(*args, devices: int = 8, timeout: int = 300) -> dict:
    """Runs ``tp_worker.py ARGS`` with ``devices`` fake CPU devices; returns its JSON result."""
    return run_script(WORKER, *args, devices=devices, timeout=timeout)


def run_script(script, *args, devices: int, timeout: int) -> dict:
    """Runs the python file ``script`` with ``ARGS`` and ``devices`` fake CPU devices (a test
    module run as its own worker); returns the JSON of its last output line."""
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                          text=True, env=worker_env(devices), timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_tiny(path: Path, kind: str) -> Path:
    """A tiny random HF checkpoint of ``kind`` (see ``TINY``) with the shared test tokenizer."""
    save_tokenizer(path)
    save_tiny_model(path, kind, **TINY[kind])
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quantized_run(done, runner, weights: dict) -> dict:
    """Of an engine's finished outputs ``done`` (one greedy completion each) and its
    ``runner``: the tokens and their logprobs, the planned weights, device 0's bytes, and the
    [codes, scales] shard shapes on device 0 of each ``QuantizedWeight`` of ``weights``."""
    import jax

    return dict(tokens=[o.token_ids for o in done],
                logprobs=[[lp[t] for t, lp in zip(o.token_ids, o.logprobs)] for o in done],
                plan_weights=runner.memory_plan.weights_bytes,
                device0_bytes=sum(s.data.nbytes for a in jax.tree.leaves(runner.params)
                                  for s in a.addressable_shards if s.device == jax.devices()[0]),
                shards={k: [list(a.addressable_shards[0].data.shape) for a in (w.qs, w.d)]
                        for k, w in weights.items()})
