"""Hybrid KV cache, measured on the CPU: the KV blocks one sequence holds after 4K generated
tokens, a scaled-down Gemma 3 (12 layers, every 6th full, window 128) run through the engine
with the hybrid cache and with every layer keeping every block (``hybrid_kv_cache=False``).

    python3 bench/hybrid_blocks.py --out bench/results/hybrid_blocks.md

One greedy request (64-token prompt, 4,096 generated, ignore_eos), random weights written by
transformers (fp32), 16-token blocks, no prefix cache. Blocks are the engine's peak
(``kv_usage_peak`` x usable blocks, reached at the end: one sequence); bytes are those blocks x
the pool's bytes per block (a hybrid block holds one page per pool slot, a full one per layer).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository root's jaxkv

from bench.lib.random_model import write_tokenizer  # noqa: E402

LAYERS, WINDOW, PROMPT, GENERATED, BLOCK = 12, 128, 64, 4096, 16


def write_model(path: str) -> None:
    """A random Gemma 3 text decoder (HF config and safetensors) and a word-level tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
        max_position_embeddings=8192, query_pre_attn_scalar=32, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    write_tokenizer(path, 400)


def measure(path: str, hybrid: bool) -> dict:
    from jaxkv import LLM, SamplingParams
    from jaxkv.runner import memory_plan

    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True)
    with LLM(path, block_size=BLOCK, max_model_len=PROMPT + GENERATED, max_num_seqs=1,
             prefix_caching=None, hybrid_kv_cache=hybrid) as llm:
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": list(range(3, 3 + PROMPT))}, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        s, plan = llm.stats(), llm.memory_plan
    blocks = round(s["kv_usage_peak"] * s["kv_blocks_total"])
    return dict(blocks=blocks, block_bytes=plan.kv_bytes_per_block,
                bytes=blocks * plan.kv_bytes_per_block, seconds=seconds,
                groups=len(memory_plan.kv_groups(llm.model_config, hybrid).windows))


def table(results: dict) -> str:
    full, hybrid = results[False], results[True]
    rows = ["| cache | groups | blocks held | bytes / block | KV bytes held | run (s) |",
            "|---|---|---|---|---|---|"]
    for name, r in (("every layer every block", full), ("hybrid", hybrid)):
        rows.append(f"| {name} | {r['groups']} | {r['blocks']:,} | {r['block_bytes']:,} | "
                    f"{r['bytes']:,} | {r['seconds']:.1f} |")
    ratio = full["bytes"] / hybrid["bytes"]
    return "\n".join(rows) + f"\n\nfull / hybrid KV bytes: **{ratio:.2f}x**\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the markdown table here too")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as path:
        write_model(path)
        results = {hybrid: measure(path, hybrid) for hybrid in (False, True)}
    text = table(results)
    print(text)
    if args.out:
        load = os.getloadavg()[0]
        Path(args.out).write_text(
            f"# Hybrid KV cache: blocks held on the CPU\n\n`python3 bench/hybrid_blocks.py "
            f"{shlex.join(argv or sys.argv[1:])}` (load average {load:.2f})\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
