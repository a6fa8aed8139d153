"""The C++ attention kernels alone (jaxkv/cpu_kernels), at SmolLM2-135M's shapes, against this
machine's limits measured in the same run.

* ``tiles``: ``paged_tiles`` over one sequence's 512-token prefill chunk, with no cached prefix
  and after a 512-token one (9 query heads, 3 kv heads, head dim 64, blocks of 16, f32, one
  layer); its GFLOP/s (4 flops per query row, key and dimension: scores and P V, causal) beside
  an XLA dot's of the model's MLP shape ([512, 576] x [576, 1536]), this machine's practical
  peak.
* ``rows``: ``paged_rows`` of a decode step, 64 sequences of 512 positions and 8 of 100, their
  blocks in pool order (as the engine allocates them) and shuffled; its GB/s of K and V read
  beside XLA reading a 512 MB array once (``jnp.sum``), this machine's read bandwidth.

Each case: a compile, then ``--repeats`` timed calls; median and quartiles (ms). The load
average is recorded beside the results.

    PYTHONPATH=. python3 bench/experiments/attention_kernels.py \
        --json bench/experiments/results/attention_kernels.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/, for lib/ and the suite
from lib.step_timing import loadavg  # noqa: E402

HKV, G, D, BS = 3, 3, 64, 16


def timed(fn, args, repeats: int) -> dict:
    """Median and quartiles (ms) of ``repeats`` calls of ``fn(*args)`` after one untimed call."""
    jax.block_until_ready(fn(*args))
    ms = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ms.append(1e3 * (time.perf_counter() - t))
    q = statistics.quantiles(ms, n=4)
    return {"ms_median": statistics.median(ms), "ms_q25": q[0], "ms_q75": q[2]}


def pools(rng, num_blocks: int):
    """K and V pools, f32 head-major [num_blocks, HKV, BS, D] (block 0 the null block)."""
    return [jnp.asarray(rng.standard_normal((num_blocks, HKV, BS, D)), jnp.float32)
            for _ in range(2)]


def tiles_case(rng, cached: int, repeats: int) -> dict:
    """One sequence's 512-token chunk after ``cached`` positions, blocks in pool order."""
    T, L = 512, cached + 512
    k, v = pools(rng, L // BS + 1)
    tables = jnp.asarray(np.arange(1, L // BS + 1)[None], jnp.int32)
    q = jnp.asarray(rng.standard_normal((T, HKV, G, D)) * D ** -0.5, jnp.float32)
    bounds = (jnp.array([0, T], jnp.int32), jnp.array([L], jnp.int32), jnp.array([T], jnp.int32))
    fn = jax.jit(lambda q, k, v, t: cpu_kernels.paged_tiles(q, k, v, t, *bounds))
    row = timed(fn, (q, k, v, tables), repeats)
    keys_seen = sum(cached + i + 1 for i in range(T))            # causal: token i sees cached+i+1
    row["gflop"] = 4 * HKV * G * D * keys_seen / 1e9
    row["gflops"] = row["gflop"] / (row["ms_median"] / 1e3)
    return row


def rows_case(rng, num_seqs: int, context: int, shuffled: bool, repeats: int) -> dict:
    """A decode step: ``num_seqs`` rows at position ``context - 1``."""
    per = -(-context // BS)
    k, v = pools(rng, num_seqs * per + 1)
    ids = np.arange(1, num_seqs * per + 1)
    if shuffled:
        ids = rng.permutation(ids)
    tables = jnp.asarray(ids.reshape(num_seqs, per), jnp.int32)
    q = jnp.asarray(rng.standard_normal((num_seqs, HKV, G, D)) * D ** -0.5, jnp.float32)
    row_pos = jnp.full((num_seqs, 1), context - 1, jnp.int32)
    fn = jax.jit(cpu_kernels.paged_rows)
    row = timed(fn, (q, k, v, tables, row_pos), repeats)
    row["mb"] = 2 * num_seqs * context * HKV * D * 4 / 1e6       # K and V of every position
    row["gbs"] = row["mb"] / 1e3 / (row["ms_median"] / 1e3)
    return row


def limits(repeats: int) -> dict:
    """This machine's practical peaks, measured now: an XLA dot's GFLOP/s at the MLP's shape,
    and XLA's read bandwidth (one pass over 512 MB)."""
    a, b = jnp.ones((512, 576)), jnp.ones((576, 1536))
    dot = timed(jax.jit(jnp.dot), (a, b), repeats)
    big = jnp.ones((128, 1 << 20), jnp.float32)
    read = timed(jax.jit(jnp.sum), (big,), max(5, repeats // 4))
    return {"dot_gflops": 2 * 512 * 576 * 1536 / 1e9 / (dot["ms_median"] / 1e3),
            "read_gbs": big.nbytes / 1e9 / (read["ms_median"] / 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not cpu_kernels.available():
        sys.exit("the C++ kernels are unavailable here")
    rng = np.random.default_rng(0)
    result = {"command": sys.argv, "machine": platform.processor() or platform.machine(),
              "load_before": loadavg()}
    result["limits"] = limits(a.repeats)
    result["tiles"] = {f"512 after {c}": tiles_case(rng, c, a.repeats) for c in (0, 512)}
    result["rows"] = {f"{s}x{c} {'shuffled' if sh else 'in order'}":
                      rows_case(rng, s, c, sh, a.repeats)
                      for s, c in ((64, 512), (8, 100)) for sh in (False, True)}
    result["load_after"] = loadavg()
    lim = result["limits"]
    print(f"limits: XLA dot {lim['dot_gflops']:.0f} GFLOP/s, XLA read {lim['read_gbs']:.1f} GB/s")
    for name, r in result["tiles"].items():
        print(f"tiles {name:16s} {r['ms_median']:7.3f} ms ({r['ms_q25']:.3f}-{r['ms_q75']:.3f})"
              f"  {r['gflops']:5.1f} GFLOP/s = {r['gflops'] / lim['dot_gflops']:.2f} of the dot")
    for name, r in result["rows"].items():
        print(f"rows  {name:16s} {r['ms_median']:7.3f} ms ({r['ms_q25']:.3f}-{r['ms_q75']:.3f})"
              f"  {r['gbs']:5.1f} GB/s = {r['gbs'] / lim['read_gbs']:.2f} of the read")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
