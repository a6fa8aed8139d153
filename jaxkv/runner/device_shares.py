"""What one tensor-parallel device holds of each checkpoint tensor, by name and shape (the
planner counts weights with it, ``sharding`` places them by the same rule): k/v heads repeated
up to the degree, row-parallel projections split along K, the rest along their rows, norms,
routers and an MLA model's latent down-projections whole."""

from __future__ import annotations

import dataclasses
import math
import re

from jaxkv.model import deepseek_names, quantize
from jaxkv.model.architectures import ARCHITECTURES
from jaxkv.model.config import ModelConfig
from jaxkv.model.weights import expected_shapes, row_parallel


def kv_replication(config: ModelConfig, tensor_parallel_size: int) -> int:
    """How many times each kv head is repeated (1 = none; an MLA model's latent is never
    repeated: its pool is replicated whole, ``cache_specs``)."""
    return 1 if config.mla else max(tensor_parallel_size // config.num_kv_heads, 1)


def tp_config(config: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The config the sharded engine runs: kv heads repeated up to ``tensor_parallel_size``."""
    r = kv_replication(config, tensor_parallel_size)
    return config if r == 1 else dataclasses.replace(config, num_kv_heads=config.num_kv_heads * r)


def device_tensor_shapes(config: ModelConfig, tensor_parallel_size: int) -> dict:
    """HF name -> the shape of the part one tp device holds (``expected_shapes`` of
    ``tp_config``): o_proj / down_proj (and an expert's down) [N, K / tp], the other dense
    weights and experts, biases, the embedding and the head split along axis 0, norms and
    routers (and an MLA model's latent down-projections, ``deepseek_names.replicated``) whole,
    anything else as its 1/tp share (as ``memory_plan.weights_bytes`` counts it)."""
    t = tensor_parallel_size
    moe = ARCHITECTURES[config.architecture].moe
    router = moe and re.compile(rf"\.{moe.block}\.{moe.router}\.(weight|bias)$")
    out = {}
    for name, shape in expected_shapes(tp_config(config, t)).items():
        if (t == 1 or "norm" in name or (config.mla and deepseek_names.replicated(name))
                or (router and router.search(name))):
            out[name] = shape
        elif row_parallel(name, config) and len(shape) == 2:
            out[name] = (shape[0], -(-shape[1] // t))
        elif re.search(r"(_proj|embed_tokens|lm_head)\.(weight|bias)$", name) or (
                quantize.EXPERT.fullmatch(name)):
            out[name] = (-(-shape[0] // t), *shape[1:])
        else:
            out[name] = (-(-math.prod(shape) // t),)
    return out
