"""KV capacity per cache dtype at one fixed KV byte budget (SmolLM2-135M), from the planner's exact
byte counts (codes + scales + zero points + block indices + the KIVI residual pool), and the CPU
throughput of the engine at that budget on a workload whose batch is limited by KV memory.

    python bench/kv_capacity.py --out bench/results/kv_capacity.json [--throughput]

Each row is a (kv dtype, block size, KIVI value group, KIVI residual window) configuration. The
budget holds the pool *and* the KIVI residual pool (``residual_blocks`` full-precision blocks per
running sequence + 1, in the model dtype), so a wider window or a larger block costs capacity.
The capacity table is for a bf16 model (``--capacity-seq-len``-token sequences, bf16 residual).

Throughput runs the CPU engine (float32 model, so a float32 residual) at ``--budget``:
``--num-requests`` requests of ``--prompt-len`` + the rest of ``--seq-len`` tokens, the engine
sized to exactly the row's pool and concurrency at that budget (``num_kv_blocks``,
``max_num_seqs``), compiled before the clock starts; output tokens per second over the whole run
(prefill included), median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from jaxkv.entrypoints.cli import parse_bytes
from jaxkv.kvcache.spec import kivi_residual_slots
from jaxkv.model.weights import load_config
from jaxkv.runner import memory_plan

# (label, kv dtype, block size, value group, residual window in blocks)
CONFIGS = (
    ("bf16", "bf16", 16, 32, 1),
    ("fp8_e4m3", "fp8_e4m3", 16, 32, 1),
    ("int8", "int8", 16, 32, 1),
    ("int4 KIVI (block 16, G 32)", "int4", 16, 32, 1),
    ("int4 (block 64, G 64)", "int4", 64, 64, 1),
    ("int2 KIVI (block 16, G 32)", "int2", 16, 32, 1),
    ("int2 (block 64, G 64)", "int2", 64, 64, 1),
    ("int2 KIVI, window 8 blocks", "int2", 16, 32, 8),
)


def capacity(config, kv, budget, block_size, seq_len, group_size, residual_blocks,
             weight_dtype="float32"):
    """(num_blocks incl. null, tokens, concurrent sequences, residual bytes) within ``budget``.

    The largest concurrency ``n`` whose pool (n sequences of ``seq_len`` tokens + the null block)
    and residual pool (``kivi_residual_slots(n, residual_blocks)`` blocks) fit together.
    """
    per_block = memory_plan.kv_bytes_per_block(config, kv, block_size, group_size=group_size)
    per_seq = -(-seq_len // block_size)
    for seqs in range(budget // (per_block * per_seq), 0, -1):
        residual = memory_plan.kivi_residual_bytes(
            config, kv, weight_dtype, block_size,
            kivi_residual_slots(seqs, residual_blocks))
        blocks = (budget - residual) // per_block
        if (blocks - 1) // per_seq >= seqs:
            return blocks, (blocks - 1) * block_size, seqs, residual
    return 0, 0, 0, 0


def throughput(kv, blocks, seqs, block_size, group_size, residual_blocks, a) -> dict:
    """Output tokens/s of ``a.num_requests`` requests through an engine of exactly this pool."""
    from jaxkv import LLM, SamplingParams

    with LLM(dtype="float32", kv_cache_dtype=kv, num_kv_blocks=blocks, block_size=block_size,
             kv_group_size=group_size, kv_residual_blocks=residual_blocks,
             max_model_len=a.seq_len, max_num_seqs=seqs, max_num_batched_tokens=256,
             token_buckets=(64, 256), seq_buckets=(max(seqs, 1),), prefix_caching=None,
             warmup=True) as llm:
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 5000 + 10
                                         for j in range(a.prompt_len)]}
                   for i in range(a.num_requests)]
        params = SamplingParams(temperature=0, max_tokens=a.seq_len - a.prompt_len,
                                ignore_eos=True)
        runs = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append(sum(len(o.outputs[0].token_ids) for o in outs)
                        / (time.perf_counter() - t0))
        s = llm.stats()
    return {"tokens_per_s_median": statistics.median(runs), "tokens_per_s_runs": runs,
            "preemptions": s["num_preemptions"], "compilations": llm.num_compilations()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity-budget", type=parse_bytes, default=parse_bytes("1GiB"))
    ap.add_argument("--capacity-seq-len", type=int, default=4096)
    ap.add_argument("--budget", type=parse_bytes, default=parse_bytes("48MiB"))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--throughput-labels", nargs="*",
                    default=["bf16", "fp8_e4m3", "int8", "int4 KIVI (block 16, G 32)",
                             "int2 KIVI (block 16, G 32)"],
                    help="the rows whose CPU throughput is measured")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench/results/kv_capacity.json")
    a = ap.parse_args()
    config = load_config("SmolLM2-135M-Instruct")
    rows = []
    for label, kv, bs, group, window in tqdm(CONFIGS, desc="kv capacity"):
        blocks, tokens, seqs, residual = capacity(config, kv, a.capacity_budget, bs,
                                                  a.capacity_seq_len, group, window, "bfloat16")
        row = {"label": label, "kv_cache_dtype": kv, "block_size": bs, "group_size": group,
               "residual_blocks": window,
               "bytes_per_token": memory_plan.kv_bytes_per_block(config, kv, bs,
                                                               group_size=group) / bs,
               "num_blocks": blocks, "tokens": tokens, "max_concurrent_seqs": seqs,
               "kivi_residual_bytes": residual}
        if a.throughput and label in a.throughput_labels:
            blocks, _, seqs, _ = capacity(config, kv, a.budget, bs, a.seq_len, group, window)
            row["cpu_throughput"] = {"num_blocks": blocks, "max_num_seqs": seqs,
                                     **throughput(kv, blocks, seqs, bs, group, window, a)}
        rows.append(row)
        tqdm.write(json.dumps(row))
    bf16 = rows[0]
    for row in rows:
        row["bytes_vs_bf16"] = bf16["bytes_per_token"] / row["bytes_per_token"]
        row["tokens_vs_bf16"] = row["tokens"] / bf16["tokens"]
        row["seqs_vs_bf16"] = row["max_concurrent_seqs"] / bf16["max_concurrent_seqs"]
        if "cpu_throughput" in row:
            row["throughput_vs_bf16"] = (row["cpu_throughput"]["tokens_per_s_median"]
                                         / bf16["cpu_throughput"]["tokens_per_s_median"])
    Path(a.out).write_text(json.dumps(
        {"model": "SmolLM2-135M-Instruct", "capacity_budget_bytes": a.capacity_budget,
         "capacity_seq_len": a.capacity_seq_len, "throughput_budget_bytes": a.budget,
         "seq_len": a.seq_len, "prompt_len": a.prompt_len, "num_requests": a.num_requests,
         "rows": rows}, indent=2))
    for row in rows:
        print(f"{row['label']:<28} {row['bytes_per_token']:>9.1f} B/token  "
              f"{row['tokens']:>7} tokens ({row['tokens_vs_bf16']:.2f}x)  "
              f"{row['max_concurrent_seqs']:>4} seqs ({row['seqs_vs_bf16']:.2f}x)"
              + (f"  {row['cpu_throughput']['max_num_seqs']:>3} seqs "
                 f"{row['cpu_throughput']['tokens_per_s_median']:.1f} tok/s "
                 f"({row['throughput_vs_bf16']:.2f}x)" if "cpu_throughput" in row else ""))


if __name__ == "__main__":
    main()
