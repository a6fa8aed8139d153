"""CPU decode step time of one MLA attention layer against GQA layers of the same hidden size at
equal context (issue 53): the layer's whole attention (projections, cache write, attention over
the paged cache, output projection) of a decode-only step of ``batch`` sequences of ``context``
tokens, fp32, jitted, through the engine's CPU path (``attention_impl="grouped"``, head-major
pools).

MLA: DeepSeek-V2-Lite's layer (hidden 2048, 16 heads, no q LoRA, latent 512 + rotary 64,
P = V = 128), absorbed (a decode step reads only the latent). GQA: Llama-style layers with the
same hidden size and 16 query heads of 128, 4 or 8 kv heads. Bytes read per token per layer:
the cache values one decode token reads for one context position (f32 here; bf16 halves them).
Each variant runs ``--repeats`` calls per round, alternating for ``--rounds`` rounds::

    python3 bench/mla_step.py --json bench/results/mla_step.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.attention.dispatch import paged_attention
from jaxkv.attention.options import AttentionOptions
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pages import init_cache
from jaxkv.kvcache.spec import KVCacheSpec
from jaxkv.model import llama, mla
from jaxkv.model.config import ModelConfig
from jaxkv.model.rope import attention_factor, inv_frequencies, rotation

sys.path.insert(0, str(Path(__file__).resolve().parent))        # bench/, for lib/
from lib.step_timing import alternating_times, loadavg, ms_summary  # noqa: E402
from mla_plan import CONFIGS  # noqa: E402

BS = 16
_GQA = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=1,
            num_attention_heads=16, head_dim=128, vocab_size=1024, rms_norm_eps=1e-5)


def layers() -> dict[str, ModelConfig]:
    lite = dict(CONFIGS["DeepSeek-V2-Lite"], num_hidden_layers=1, first_k_dense_replace=0)
    return {"MLA (V2-Lite)": ModelConfig.from_hf_dict(lite),
            **{f"GQA-{h}": ModelConfig.from_hf_dict(dict(_GQA, num_key_value_heads=h))
               for h in (4, 8)}}


def bytes_read_per_position(c: ModelConfig, dtype_bytes: int = 4) -> int:
    """Cache bytes one decode token reads per context position of one layer."""
    return (1 if c.mla else 2) * c.num_kv_heads * c.head_dim * dtype_bytes


def decode_step(c: ModelConfig, batch: int, context: int, seed: int = 0):
    """(jitted step, its inputs): a decode token per sequence after ``context - 1`` cached
    random positions, random weights."""
    rng = np.random.default_rng(seed)
    layer = (mla.LatentAttention(c, jnp.float32, llama.RMSNorm) if c.mla
             else llama.Attention(c, jnp.float32))
    graph, state = nnx.split(layer)
    state = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) / np.sqrt(x.shape[0]),
                                               jnp.float32), state)
    blocks = context // BS
    spec = KVCacheSpec(num_layers=1, num_blocks=batch * blocks + 1, block_size=BS,
                       num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                       v_head_dim=c.kv_cache_v_dim, dtype="float32", layout="hnd")
    cache = init_cache(spec)
    pools = tuple(jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), p)
                  for p in (cache.k[0], cache.v[0])) + (None,)
    tables = 1 + np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
    md = AttentionMetadata(slot_mapping=jnp.asarray(tables[:, -1] * BS + BS - 1),
                           query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32),
                           seq_lens=jnp.full(batch, context, jnp.int32),
                           block_tables=jnp.asarray(tables), decode_only=True)
    rot = rotation(jnp.full(batch, context - 1), inv_frequencies(c), attention_factor(c))
    x = jnp.asarray(rng.normal(size=(batch, c.hidden_size)), jnp.float32)

    @jax.jit
    def step(state, x, pools, md):
        out, _, _ = nnx.merge(graph, state)(x, rot, pools, md, options=AttentionOptions(),
                                            impl="grouped", interpret=False,
                                            attention=paged_attention)
        return out

    return step, (state, x, pools, md)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"load_before": loadavg(), "rows": []}
    print(f"{'layer':<14} {'B/pos':>6} {'batch':>5} {'context':>7} {'ms median':>9} {'ms min':>7}")
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            calls = {}
            for name, c in layers().items():
                step, inputs = decode_step(c, batch, context)
                jax.block_until_ready(step(*inputs))                      # compile
                calls[name] = functools.partial(
                    lambda f, a: jax.block_until_ready(f(*a)), step, inputs)
            times = alternating_times(calls, args.rounds, args.repeats)
            for name, c in layers().items():
                row = dict(layer=name, bytes_per_position=bytes_read_per_position(c),
                           batch=batch, context=context, **ms_summary(times[name]))
                out["rows"].append(row)
                print(f"{name:<14} {row['bytes_per_position']:>6} {batch:>5} {context:>7} "
                      f"{row['ms_median']:>9.2f} {row['ms_min']:>7.2f}", flush=True)
    out["load_after"] = loadavg()
    print(f"load {out['load_before']} -> {out['load_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
