"""The row path's gather + dots with the KV pool laid out NHD (today) or HND: is a layout change
worth it on XLA CPU?

jaxkv's pools are NHD, ``[num_blocks, block_size, Hkv, D]``. The grouped row path
(jaxkv/attention/grouped.py) gathers each loop step's units as ``[S, n * block_size, Hkv, D]``
and contracts them with batched dots over (unit, kv head), so XLA transposes every gathered
chunk to put the head next to the unit (the ``transpose_copy_fusion`` that took 12 of 28 ms in
BENCHMARKS.md's row-path profile). With an HND pool, ``[num_blocks, Hkv, block_size, D]``, a
gathered block is already ``[Hkv, block_size, D]``, and dots batched over (unit, block, kv head)
read it as it lies.

Both variants run the same loop, a model of the row path's core: each case's loop steps each
gather ``S`` units of ``n`` random blocks of K and V (``jaxkv.kvcache.pools.take_blocks``, as the
engine does), then q·k, a max-subtracted exp, p·v, accumulated (``CASES``). SmolLM2-135M's
shapes (3 kv heads, 3 q heads per kv head, head_dim 64, block 16, fp32). The outputs are checked
equal; then each variant runs ``--repeats`` calls per round, alternating for ``--rounds``
rounds; median and min ms and the load average::

    python3 bench/experiments/kv_layout.py --json bench/experiments/results/kv_layout.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kvcache.pools import take_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/, for lib/ and the suite
from lib.step_timing import alternating_times, loadavg, ms_summary  # noqa: E402

BS, HKV, G, D = 16, 3, 3, 64
CASES = [(128, 2, 20), (128, 1, 40), (64, 2, 20), (8, 4, 20), (1, 16, 16)]   # (S, n, steps)


def nhd(q, k_pool, v_pool, ids):
    """q [S, Hkv, G, D]; pools [N, BS, Hkv, D]; ids [steps, S, n] -> [S, Hkv, G, D]."""
    S, n = ids.shape[1:]

    def step(t, acc):
        k = take_blocks(k_pool, ids[t]).reshape(S, n * BS, HKV, D)
        v = take_blocks(v_pool, ids[t]).reshape(S, n * BS, HKV, D)
        s = jnp.einsum("shgd,srhd->srhg", q, k)
        p = jnp.exp(s - s.max(1, keepdims=True))
        return acc + jnp.einsum("srhg,srhd->shgd", p, v)

    return jax.lax.fori_loop(0, ids.shape[0], step, jnp.zeros(q.shape, jnp.float32))


def hnd(q, k_pool, v_pool, ids):
    """q [S, Hkv, G, D]; pools [N, Hkv, BS, D]; ids [steps, S, n] -> [S, Hkv, G, D]."""
    def step(t, acc):
        k, v = take_blocks(k_pool, ids[t]), take_blocks(v_pool, ids[t])   # [S, n, Hkv, BS, D]
        s = jnp.einsum("shgd,snhbd->snhgb", q, k)
        p = jnp.exp(s - s.max((1, 4), keepdims=True))
        return acc + jnp.einsum("snhgb,snhbd->shgd", p, v)

    return jax.lax.fori_loop(0, ids.shape[0], step, jnp.zeros(q.shape, jnp.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    variants = {"NHD": jax.jit(nhd), "HND": jax.jit(hnd)}
    out = {"jax": jax.__version__, "repeats": a.repeats, "rounds": a.rounds, "cases": []}
    print("| S units x n blocks, steps | K+V MB | NHD ms | HND ms | HND / NHD | load |")
    print("|---|---|---|---|---|---|")
    for S, n, steps in CASES:
        num_blocks = S * n * steps + 1
        k = jnp.asarray(rng.standard_normal((num_blocks, BS, HKV, D)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((num_blocks, BS, HKV, D)), jnp.float32)
        pools = {"NHD": (k, v), "HND": tuple(jnp.array(x.transpose(0, 2, 1, 3)) for x in (k, v))}
        ids = jnp.asarray(rng.permutation(np.arange(1, num_blocks)).reshape(steps, S, n),
                          jnp.int32)
        q = jnp.asarray(rng.standard_normal((S, HKV, G, D)), jnp.float32)
        want = np.asarray(variants["NHD"](q, k, v, ids))
        np.testing.assert_allclose(np.asarray(variants["HND"](q, *pools["HND"], ids)), want,
                                   rtol=1e-4, atol=1e-3)
        before = loadavg()
        times = alternating_times(
            {name: partial(lambda f, pk, pv: jax.block_until_ready(f(q, pk, pv, ids)), f,
                           *pools[name]) for name, f in variants.items()}, a.rounds, a.repeats)
        summary = {name: ms_summary(ts) for name, ts in times.items()}
        med = {name: x["ms_median"] for name, x in summary.items()}
        low = {name: x["ms_min"] for name, x in summary.items()}
        mb = 2 * S * n * steps * BS * HKV * D * 4 / 1e6
        row = {"S": S, "n": n, "steps": steps, "kv_mb": mb, "ms_median": med, "ms_min": low,
               "load_before": before, "load_after": loadavg()}
        out["cases"].append(row)
        print(f"| {S} x {n}, {steps} | {mb:.0f} | {med['NHD']:.2f} ({low['NHD']:.2f}) | "
              f"{med['HND']:.2f} ({low['HND']:.2f}) | {med['HND'] / med['NHD']:.2f} | "
              f"{before[0]}-{row['load_after'][0]} |", flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
