"""MLA prefill on CPU: the absorbed form (jaxkv/attention/mla.py's grouped path, the engine's CPU
path) against the expanded form (jaxkv/attention/mla_prefill.py) for one sequence's prefill
chunk of q tokens at the end of a context of J positions, fp32, jitted; where the expanded form
becomes cheaper, against the multiply-add model's ``Lkv (P + V) / (2 Lkv - P - V)``
(``expanded_min_tokens`` with a factor of 1).

Shapes: DeepSeek's per-head widths (Lkv 512, P = V = 128, R 64) with V2-Lite's 16 heads and
V3's 128 heads scaled to 32 (the model's crossover does not depend on the heads). A head-major
(HND) f32 latent pool of 16-token blocks, as the engine lays it out on CPU. Prints a table and
each (heads, J)'s crossover, interpolated where the time ratio crosses 1::

    python3 bench/mla_prefill.py --json bench/results/mla_prefill.json
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

from jaxkv.attention.mla import mla_attention
from jaxkv.attention.mla_prefill import expanded_min_tokens, mla_prefill_attention
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pools import HNDPages

sys.path.insert(0, str(Path(__file__).resolve().parent))        # bench/, for lib/
from lib.step_timing import alternating_times, loadavg, ms_summary  # noqa: E402

LKV, P, R, V, BS = 512, 128, 64, 128, 16


def step(num_heads: int, context: int, chunk: int, seed: int = 0):
    """Random inputs of one sequence's step: its last ``chunk`` of ``context`` positions."""
    rng = np.random.default_rng(seed)
    blocks = context // BS
    pool = HNDPages(jnp.asarray(rng.normal(size=(blocks + 1, 1, BS, LKV + R)), jnp.float32))
    md = AttentionMetadata(slot_mapping=jnp.zeros(chunk, jnp.int32),
                           query_start_loc=jnp.asarray([0, chunk], jnp.int32),
                           seq_lens=jnp.asarray([context], jnp.int32),
                           block_tables=jnp.asarray(1 + rng.permutation(blocks)[None], jnp.int32))
    scale = LKV ** -0.5
    q_nope, q_rope, w_uk, w_uv = (jnp.asarray(rng.normal(size=s) * d, jnp.float32) for s, d in (
        ((chunk, num_heads, P), 1), ((chunk, num_heads, R), 1), ((LKV, num_heads, P), scale),
        ((LKV, num_heads, V), scale)))
    return q_nope, q_rope, pool, w_uk, w_uv, md


def forms(sm_scale: float):
    absorbed = jax.jit(functools.partial(mla_attention, sm_scale=sm_scale, impl="grouped"))

    @jax.jit
    def expanded(q_nope, q_rope, pool, w_uk, w_uv, md):
        return mla_prefill_attention(q_nope, q_rope, pool, w_uk, w_uv, md.block_tables,
                                     md.seq_lens, md.query_start_loc, jnp.ones(1, bool),
                                     sm_scale=sm_scale)

    return {"absorbed": absorbed, "expanded": expanded}


def crossover(rows: list[dict]) -> float | None:
    """The chunk length where expanded / absorbed crosses 1 (log-log interpolation), or None."""
    for a, b in zip(rows, rows[1:]):
        ra, rb = a["expanded_ms"] / a["absorbed_ms"], b["expanded_ms"] / b["absorbed_ms"]
        if ra >= 1 > rb:
            t = np.log(ra) / (np.log(ra) - np.log(rb))
            return float(np.exp(np.log(a["chunk"]) + t * np.log(b["chunk"] / a["chunk"])))
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16,32")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--chunks", default="32,64,128,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    run = forms(LKV ** -0.5)
    out = {"load_before": loadavg(), "model_crossover": LKV * (P + V) / (2 * LKV - P - V),
           "expanded_min_tokens": expanded_min_tokens(LKV, P, V), "rows": [], "crossovers": []}
    print(f"{'heads':>5} {'J':>5} {'q':>4} {'absorbed ms':>11} {'expanded ms':>11} {'exp/abs':>7}")
    for heads in map(int, args.heads.split(",")):
        for context in map(int, args.contexts.split(",")):
            rows = []
            for chunk in map(int, args.chunks.split(",")):
                inputs = step(heads, context, chunk)
                got = {k: f(*inputs) for k, f in run.items()}
                np.testing.assert_allclose(got["expanded"], got["absorbed"], atol=1e-3, rtol=1e-3)
                times = alternating_times(
                    {k: functools.partial(lambda f: jax.block_until_ready(f(*inputs)), f)
                     for k, f in run.items()}, rounds=1, repeats=args.repeats)
                row = dict(heads=heads, context=context, chunk=chunk,
                           **{f"{k}_ms": ms_summary(t)["ms_median"] for k, t in times.items()})
                rows.append(row)
                print(f"{heads:>5} {context:>5} {chunk:>4} {row['absorbed_ms']:>11.1f} "
                      f"{row['expanded_ms']:>11.1f} {row['expanded_ms'] / row['absorbed_ms']:>7.2f}",
                      flush=True)
            out["rows"] += rows
            out["crossovers"].append(dict(heads=heads, context=context, chunk=crossover(rows)))
    out["load_after"] = loadavg()
    for c in out["crossovers"]:
        print(f"heads {c['heads']} J {c['context']}: expanded cheaper from q ~ {c['chunk']}")
    print(f"model {out['model_crossover']:.0f}; expanded_min_tokens {out['expanded_min_tokens']};"
          f" load {out['load_before']} -> {out['load_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
