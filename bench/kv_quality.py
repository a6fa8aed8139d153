"""Quality of each KV cache dtype on SmolLM2-135M: perplexity on Austen through the engine path
(jaxkv.entrypoints.eval), greedy agreement with the fp32 cache, and the KIVI 2-bit ablation.

    python bench/kv_quality.py --out bench/results/kv_quality.json

Perplexity: ``emma.txt``, windows of ``--context`` tokens (disjoint), ``--windows`` of them for
the main table (10 x 2048 = 20,480 scored tokens) and ``--ablation-windows`` for the ablation.
fp/int8 rows feed 256-token chunks; KIVI rows use a residual window of ``--residual-blocks``
blocks and ``--kivi-chunk``-token chunks, so every query reads its recent tokens in full precision
as in decoding (see jaxkv/entrypoints/eval.py).

Agreement, after the first ``--prompt-tokens`` tokens of *Pride and Prejudice*, against the fp32
cache's greedy continuation of ``--gen-tokens`` tokens:
  * teacher-forced: each dtype decodes the fp32 continuation token by token; fraction of steps
    whose argmax is the fp32 token (``jaxkv.entrypoints.eval.token_agreement``);
  * free-running: the dtype's own greedy continuation through ``LLM.generate``: the first position
    that differs, and the fp32 top-1 minus top-2 log-probability margin at that position (a
    near-tie there flips on any perturbation and makes the rest of the text differ).

Rows are appended to the JSON file as they finish (a partial run keeps its rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from tqdm import tqdm

from jaxkv import LLM, SamplingParams
from jaxkv.data import austen
from jaxkv.entrypoints.eval import perplexity, token_agreement
from jaxkv.kvcache.pages import init_cache

FLOAT_AND_8BIT = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")
# KIVI 2-bit ablation: (name, KVCacheSpec options besides the residual window)
ABLATION = (
    ("int2 KIVI (K channel, V token)", {}),
    ("int2 K channel, V channel", dict(key_axis="channel", value_axis="channel")),
    ("int2 K token, V token", dict(key_axis="token", value_axis="token")),
    ("int2 K token, V channel", dict(key_axis="token", value_axis="channel")),
    ("int2 KIVI, residual window 1 block", dict(residual_blocks=1)),
    ("int2 KIVI, residual off", dict(residual_full_precision=False)),
)


def free_running(llm, kv, options, prompt_ids, n, logprobs=None):
    """The greedy continuation through the engine with its cache swapped for a ``kv`` one of
    the same pool (``options``: KVCacheSpec fields; one sequence's residual slots)."""
    runner = llm.engine.runner
    runner.cache = init_cache(dataclasses.replace(runner.kv_spec, kv_cache_dtype=kv,
                                                  num_residual_slots=None, layout="nhd",
                                                  **options))
    out = llm.generate([{"prompt_token_ids": prompt_ids}],
                       SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                      logprobs=logprobs), use_tqdm=False)
    return out[0].outputs[0]


def margins(completion):
    """fp32 top-1 minus top-2 log-probability at each position of a logprobs=2 completion."""
    out = []
    for lp in completion.logprobs:
        top = sorted(lp.values(), reverse=True)
        out.append(top[0] - top[1])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kv_quality.json")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=10, help="ppl windows per main row")
    ap.add_argument("--ablation-windows", type=int, default=3)
    ap.add_argument("--residual-blocks", type=int, default=8,
                    help="KIVI residual window in blocks (8 x 16 = KIVI's 128 tokens)")
    ap.add_argument("--kivi-chunk", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--only", nargs="*", default=None, help="run only these row names")
    a = ap.parse_args()
    llm = LLM(dtype="float32", max_model_len=a.context, max_num_seqs=1, block_size=16,
              num_kv_blocks=a.context // 16 + 1, max_num_batched_tokens=256,
              token_buckets=(1, 16, 256), seq_buckets=(1,), prefix_caching=None)
    ids = llm.tokenizer.encode(austen("emma")[:400_000])
    prompt = llm.tokenizer.encode(
        austen("pride_and_prejudice")[:20_000]
    )[:a.prompt_tokens]
    kivi = dict(residual_blocks=a.residual_blocks)
    result = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to f32)",
              "ppl_text": "emma.txt", "context": a.context, "block_size": 16,
              "residual_blocks": a.residual_blocks, "kivi_chunk": a.kivi_chunk,
              "agreement_prompt": f"first {a.prompt_tokens} tokens of pride_and_prejudice.txt",
              "gen_tokens": a.gen_tokens, "rows": []}
    ref_out = free_running(llm, "fp32", {}, prompt, a.gen_tokens, logprobs=2)
    ref, ref_margin = ref_out.token_ids, margins(ref_out)
    # (table, name, kv dtype, options, chunk, windows)
    rows = [("main", kv, kv, {}, 256, a.windows) for kv in FLOAT_AND_8BIT]
    rows += [("main", f"{kv} KIVI", kv, kivi, a.kivi_chunk, a.windows) for kv in ("int4", "int2")]
    rows += [("ablation", "fp32", "fp32", {}, 256, a.ablation_windows)]
    rows += [("ablation", name, "int2", {**kivi, **opts}, a.kivi_chunk, a.ablation_windows)
             for name, opts in ABLATION]
    for table, name, kv, opts, chunk, windows in tqdm(rows, desc="kv quality"):
        if a.only is not None and name not in a.only:
            continue
        t0 = time.perf_counter()
        agree = token_agreement(llm.engine.runner, prompt, ref, kv_cache_dtype=kv, **opts)
        own = free_running(llm, kv, opts, prompt, a.gen_tokens).token_ids
        first = next((i for i, (x, y) in enumerate(zip(own, ref)) if x != y), len(ref))
        r = perplexity(llm.engine.runner, ids, kv_cache_dtype=kv, context=a.context, chunk=chunk,
                       max_windows=windows, **opts)
        row = {"table": table, "name": name, "kv_cache_dtype": kv, "options": opts,
               "chunk": chunk, "ppl": r.perplexity, "scored_tokens": r.num_scored,
               "windows": r.num_windows, "teacher_forced_agreement": agree.agreement,
               "free_running_first_difference": first,
               "fp32_margin_there": ref_margin[first] if first < len(ref) else None,
               "seconds": time.perf_counter() - t0}
        result["rows"].append(row)
        tqdm.write(json.dumps(row))
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
