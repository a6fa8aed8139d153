"""The grouped attention's decode rows and prefill tiles at the throughput workload's shapes.

One layer of ``jaxkv.attention.grouped.paged_attention_grouped`` at SmolLM2-135M's shapes (9 q
heads, 3 kv heads, head_dim 64, block 16, fp32, random permuted blocks): decode steps of ``n``
rows in a sequence bucket of ``S`` whose kv lengths are drawn uniformly from a range, as in
bench/throughput.py's 128-request workload (prompts 32-512 tokens, outputs 16-256: contexts
~50-770; tables 64 blocks wide = max_model_len 1024), the same rows at one length (no
raggedness), and batch 1 and 2 at 64 to 4,000 tokens (tables 512 wide = SmolLM2's 8,192);
and prefill steps (the tile path): 512-token chunks of one prompt, fresh or after a cached
prefix, four 128-token prompts, and the workload's mixed step of one chunk beside decode rows.
Today's tree runs against the module as it was at ``--rev`` (loaded from git), both on the same
pools laid out NHD and, as the engine's CPU default holds them, HND
(``jaxkv.kvcache.pools.HNDPages``; today's HND rows are the C++ kernel of jaxkv/cpu_kernels where it
builds); with ``--chunk-bytes`` also with other row chunk budgets (``_ROW_CHUNK_BYTES``). After a
compile each variant runs ``--repeats`` back-to-back calls, in blocks alternating between the
variants (``--rounds`` rounds against load drift); median and min wall ms, the outputs' max difference
from the reference, and the load average.

    python3 bench/experiments/row_path.py --rev HEAD~1 \
        --json bench/experiments/results/row_path.json
    python3 bench/experiments/row_path.py --rev HEAD~1 --chunk-bytes 256K,1M,4M
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import grouped
from jaxkv.attention.reference import paged_attention_reference
from jaxkv.kvcache.pools import HNDPages

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/, for lib/ and the suite
from lib.ragged_batches import table_batch  # noqa: E402
from lib.step_timing import alternating_times, loadavg, ms_summary  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16
# name: (S bucket, rows, kv length range, table width in blocks: 64 = max_model_len 1024)
CASES = {
    "8 rows, 300-620": (8, 7, (300, 620), 64),
    "32 rows, 48-770": (32, 28, (48, 770), 64),
    "64 rows, 48-770": (64, 60, (48, 770), 64),
    "128 rows, 48-770": (128, 104, (48, 770), 64),
    "128 rows, 400 each": (128, 128, (400, 400), 64),
    # batch 1 and 2 at SmolLM2's whole context (8,192: tables 512 wide)
    "1 row, 64": (1, 1, (64, 64), 512),
    "1 row, 256": (1, 1, (256, 256), 512),
    "1 row, 1024": (1, 1, (1024, 1024), 512),
    "1 row, 4000": (1, 1, (4000, 4000), 512),
    "2 rows, 4000": (2, 2, (4000, 4000), 512),
}
# name: (S bucket, T tokens, [(query tokens, kv length) of each sequence], table width)
PREFILL_CASES = {
    "prefill 512": (1, 512, [(512, 512)], 64),
    "prefill 512 after 512": (1, 512, [(512, 1024)], 64),
    "prefill 4 x 128": (4, 512, [(128, 128)] * 4, 64),
    "prefill 452 + 60 rows": (64, 512, [(452, 452)] + [(1, 48 + 12 * i) for i in range(60)], 64),
}


def module_at(rev: str) -> types.ModuleType:
    """jaxkv/attention/grouped.py as it was at git revision ``rev``."""
    src = subprocess.run(["git", "show", f"{rev}:jaxkv/attention/grouped.py"], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    m = types.ModuleType(f"attention_grouped_at_{rev}")
    exec(compile(src, f"{rev}:jaxkv/attention/grouped.py", "exec"), m.__dict__)
    return m


def parse_bytes(x: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(x[:-1]) * units[x[-1]] if x[-1] in units else int(x)


def variant(module: types.ModuleType, chunk_bytes: int | None):
    """``module``'s attention, jitted, tracing with ``_ROW_CHUNK_BYTES = chunk_bytes``."""
    def f(*args):
        saved = module._ROW_CHUNK_BYTES
        module._ROW_CHUNK_BYTES = chunk_bytes or saved
        try:
            return module.paged_attention_grouped(*args)
        finally:
            module._ROW_CHUNK_BYTES = saved
    return jax.jit(f)


def case_args(rng, S, T, q_lens, kv, max_blocks):
    """Random queries and pools for sequences of ``q_lens`` query tokens at kv lengths ``kv``."""
    nb = 2 + sum(-(-x // BS) for x in kv)
    tables, lens, qsl = table_batch(rng, q_lens, kv, T=T, S=S, max_blocks=max_blocks,
                                    num_blocks=nb, bs=BS)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    return (normal(T, HQ, D), normal(nb, BS, HKV, D), normal(nb, BS, HKV, D),
            tables, lens, qsl), float(np.mean(kv))


def all_cases(rng) -> dict:
    """name: (S, T, query lengths, kv lengths, table width) of every case."""
    out = {}
    for name, (S, n, (lo, hi), max_blocks) in CASES.items():
        out[name] = (S, S, [1] * n, [int(x) for x in rng.integers(lo, hi + 1, n)], max_blocks)
    for name, (S, T, seqs, max_blocks) in PREFILL_CASES.items():
        out[name] = (S, T, [q for q, _ in seqs], [kv for _, kv in seqs], max_blocks)
    return out


def hnd_args(args):
    """``case_args``' arguments with the K and V pools as their HND copies."""
    q, k, v, *rest = args
    return (q, *(HNDPages(jnp.array(p.transpose(0, 2, 1, 3))) for p in (k, v)), *rest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD~1", help="git revision to compare against")
    ap.add_argument("--chunk-bytes", default="", help="also today's code at these row chunk "
                    "budgets, comma list (256K,1M,...)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="", help="only these cases (names separated by ;)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    known = all_cases(rng)
    names = a.cases.split(";") if a.cases else list(known)
    if unknown := [k for k in names if k not in known]:
        ap.error(f"--cases: unknown {unknown}; the cases are {list(known)}")
    # name: (jitted attention, reads the HND pools)
    old = module_at(a.rev)
    variants = {f"@{a.rev}": (variant(old, None), False),
                f"@{a.rev}, HND": (variant(old, None), True),
                "today": (variant(grouped, None), False),
                "today, HND": (variant(grouped, None), True)}
    for cb in filter(None, a.chunk_bytes.split(",")):
        variants[f"today, {cb} chunks"] = (variant(grouped, parse_bytes(cb)), False)
    out = {"rev": a.rev, "repeats": a.repeats, "rounds": a.rounds, "cases": {}}
    print("| case | mean kv | " + " | ".join(f"{v} ms" for v in variants) + " | load |")
    print("|---|---|" + "---|" * len(variants) + "---|")
    for name in names:
        S, T, q_lens, kv, max_blocks = known[name]
        args, mean_kv = case_args(rng, S, T, q_lens, kv, max_blocks)
        layouts = {False: args, True: hnd_args(args)}
        n = sum(q_lens)                                                # tokens with an output
        ref = np.asarray(paged_attention_reference(*args))[:n]
        diff = {v: float(np.abs(np.asarray(f(*layouts[h]))[:n] - ref).max())
                for v, (f, h) in variants.items()}                # also compiles each
        before = loadavg()
        times = alternating_times(
            {v: partial(lambda f, xs: jax.block_until_ready(f(*xs)), f, layouts[h])
             for v, (f, h) in variants.items()}, a.rounds, a.repeats)
        row = {"S": S, "T": T, "query_lens": q_lens, "kv_lens": kv, "mean_kv": mean_kv,
               "load_before": before, "load_after": loadavg(), "variants": {}}
        for v, ts in times.items():
            row["variants"][v] = {**ms_summary(ts), "max_abs_diff": diff[v]}
        out["cases"][name] = row
        cells = " | ".join(f"{r['ms_median']:.2f} ({r['ms_min']:.2f})"
                           for r in row["variants"].values())
        print(f"| {name} | {mean_kv:.0f} | {cells} | {before[0]}-{row['load_after'][0]} |",
              flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
