"""Quality of each KV cache dtype on SmolLM2-135M: perplexity on Austen through the engine path
(jaxkv.eval) and greedy-token agreement with the fp32 cache, plus the KIVI 2-bit ablation.

    python bench/kv_quality.py --out bench/results/kv_quality.json

Rows are appended to the JSON file as they finish (a partial run keeps its rows).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jaxkv import LLM, SamplingParams
from jaxkv.cache import init_cache
from jaxkv.eval import perplexity

AUSTEN = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen"
DTYPES = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2")
# KIVI ablation at 2 bits: (name, init_cache options)
ABLATION = (
    ("int2 K-token V-token", dict(key_axis="token", value_axis="token")),
    ("int2 K-channel V-channel", dict(key_axis="channel", value_axis="channel")),
    ("int2 K-token V-channel", dict(key_axis="token", value_axis="channel")),
    ("int2 KIVI residual off", dict(residual_full_precision=False)),
)


def greedy(llm, kv, options, prompt_ids, n):
    c = llm.model_config
    llm.cache = init_cache(c.num_layers, llm.cache_config.num_blocks,
                           llm.cache_config.block_size, c.num_kv_heads, c.head_dim, llm.dtype,
                           kv_cache_dtype=kv, num_residual_slots=2, **options)
    out = llm.generate([{"prompt_token_ids": prompt_ids}],
                       SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kv_quality.json")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=2, help="ppl windows per main dtype")
    ap.add_argument("--ablation-windows", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--only", nargs="*", default=None,
                    help="run only these row names (the fp32 greedy reference always runs)")
    a = ap.parse_args()
    llm = LLM(dtype="float32", max_model_len=a.context, max_num_seqs=1, block_size=16,
              num_kv_blocks=a.context // 16 + 1, max_num_batched_tokens=256,
              token_buckets=(16, 256), seq_buckets=(1,), prefix_caching=None)
    ids = llm.tokenizer.encode((AUSTEN / "emma.txt").read_text(encoding="utf-8")[:400_000])
    prompt = llm.tokenizer.encode(
        (AUSTEN / "pride_and_prejudice.txt").read_text(encoding="utf-8")[:20_000]
    )[:a.prompt_tokens]
    result = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to f32)",
              "ppl_text": "emma.txt", "context": a.context, "chunk": 256, "block_size": 16,
              "agreement_prompt": f"first {a.prompt_tokens} tokens of pride_and_prejudice.txt",
              "gen_tokens": a.gen_tokens, "rows": []}
    ref = greedy(llm, "fp32", {}, prompt, a.gen_tokens)
    configs = [(kv, kv, {}, a.windows) for kv in DTYPES]
    configs += [(name, "int2", opts, a.ablation_windows) for name, opts in ABLATION]
    for name, kv, opts, windows in configs:
        if a.only is not None and name not in a.only:
            continue
        t0 = time.perf_counter()
        toks = greedy(llm, kv, opts, prompt, a.gen_tokens)
        prefix = next((i for i, (x, y) in enumerate(zip(toks, ref)) if x != y), len(ref))
        r = perplexity(llm, ids, kv_cache_dtype=kv, context=a.context, chunk=256,
                       max_windows=windows, **opts)
        row = {"name": name, "kv_cache_dtype": kv, "options": opts, "ppl": r.perplexity,
               "scored_tokens": r.num_scored, "windows": r.num_windows,
               "greedy_agree_positional": sum(x == y for x, y in zip(toks, ref)) / len(ref),
               "greedy_agree_prefix": prefix, "seconds": time.perf_counter() - t0}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
