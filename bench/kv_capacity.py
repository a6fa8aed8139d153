"""KV capacity per cache dtype at one fixed KV byte budget (SmolLM2-135M), from the planner's exact
byte counts (codes + scales + zero points + the KIVI residual pool), and optionally the CPU
decode throughput of the engine at that budget.

    python bench/kv_capacity.py --budget 64MiB --out bench/results/kv_capacity.json [--throughput]

Sequences are ``--seq-len`` tokens; KIVI dtypes pay one full-precision residual block per
running sequence (``max_num_seqs + 1`` slots), which is taken out of the same budget.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jaxkv import planner
from jaxkv.cli import parse_bytes
from jaxkv.model.weights import load_config

DTYPES = ("fp32", "bf16", "fp8_e4m3", "int8", "int4", "int2")


def capacity(config, kv, budget, block_size, seq_len, weight_dtype="float32"):
    """(num_blocks incl. null, tokens, concurrent sequences, residual bytes) within ``budget``."""
    per_block = planner.kv_bytes_per_block(config, kv, block_size)
    per_seq = -(-seq_len // block_size)
    seqs = budget // (per_block * per_seq)
    while seqs > 0:
        residual = planner.kivi_residual_bytes(config, kv, weight_dtype, block_size, seqs + 1)
        blocks = (budget - residual) // per_block
        if (blocks - 1) // per_seq >= seqs:
            return blocks, (blocks - 1) * block_size, seqs, residual
        seqs -= 1
    return 0, 0, 0, 0


def throughput(kv, blocks, seqs, block_size, seq_len, prompt_len):
    from jaxkv import LLM, SamplingParams

    with LLM(dtype="float32", kv_cache_dtype=kv, num_kv_blocks=blocks, block_size=block_size,
             max_model_len=seq_len, max_num_seqs=seqs, max_num_batched_tokens=256,
             prefix_caching=None) as llm:
        prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(prompt_len)]}
                   for i in range(seqs)]
        params = SamplingParams(temperature=0, max_tokens=seq_len - prompt_len, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        s = llm.stats()
    return {"generated_tokens": s["num_generated_tokens"], "seconds": dt,
            "tokens_per_s": s["num_generated_tokens"] / dt, "preemptions": s["num_preemptions"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=parse_bytes, default=parse_bytes("64MiB"))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=448)
    ap.add_argument("--out", default="bench/results/kv_capacity.json")
    a = ap.parse_args()
    config = load_config("SmolLM2-135M-Instruct")
    rows = []
    for kv in DTYPES:
        blocks, tokens, seqs, residual = capacity(config, kv, a.budget, a.block_size, a.seq_len)
        row = {"kv_cache_dtype": kv,
               "bytes_per_token": planner.kv_bytes_per_block(config, kv, a.block_size)
               / a.block_size,
               "num_blocks": blocks, "tokens": tokens, "max_concurrent_seqs": seqs,
               "kivi_residual_bytes": residual}
        rows.append(row)
    bf16 = next(r for r in rows if r["kv_cache_dtype"] == "bf16")
    for row in rows:
        row["tokens_vs_bf16"] = row["tokens"] / bf16["tokens"]
        row["seqs_vs_bf16"] = row["max_concurrent_seqs"] / bf16["max_concurrent_seqs"]
        if a.throughput:
            row["cpu_throughput"] = throughput(row["kv_cache_dtype"], row["num_blocks"],
                                               row["max_concurrent_seqs"], a.block_size,
                                               a.seq_len, a.prompt_len)
        print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps(
        {"model": "SmolLM2-135M-Instruct", "budget_bytes": a.budget, "block_size": a.block_size,
         "seq_len": a.seq_len, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
