"""CPU attention: the reference (the specification) against the grouped path, per layer and e2e.

Four measurements, in one process, the load average recorded beside each:

* ``micro``: one layer's ``paged_attention`` at SmolLM2-135M's shapes (9 q heads, 3 kv heads,
  head_dim 64, block 16, fp32, block tables 128 wide = max_model_len 2048, random permuted
  blocks): prefill of a 512-token chunk (no cached prefix, and after a 512-token prefix), decode
  of 8 and 64 sequences at 512 and 2048 tokens of context; after a compile, two rounds of
  ``--repeats`` back-to-back runs of each impl (blocks, not single calls, alternate: the
  reference's large gathers would otherwise evict the caches the next call starts from);
  median (and min) wall time and median process-CPU time of the ``2 x repeats`` runs.
* ``compile``: seconds to compile the engine step of a few (T, S) buckets with each impl (the
  persistent compilation cache off).
* ``parity``: greedy fp32 SmolLM2 outputs of a few Austen prompts through ``jaxkv.LLM`` with
  each impl, token by token; at a first difference, the fp32 top-2 logprob margin there.
* ``e2e``: ``jaxkv.LLM`` throughput with each impl on bench/throughput.py's engine settings
  (fp32, 512 tokens per step, max_model_len 1024; a 2049-block pool), prompts cut from Pride
  and Prejudice: prefill (8 x 512-token prompts, and 64 x 64, one output token), decode (the
  same prompts with 129 output tokens: 128 decode tokens per request over the prefill run's
  time) and a mixed workload (32 requests, prompts 32-512 tokens, outputs 16-128, greedy). Both engines
  live in the process; each workload runs once per engine to compile its buckets, then
  ``--e2e-repeats`` rounds of one run per engine, the prefix cache reset before each; medians.

    python3 bench/experiments/attention_cpu.py --out bench/experiments/results/attention_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import LLM, SamplingParams
from jaxkv.attention.dispatch import paged_attention
from jaxkv.data import BOOKS, austen

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/, for lib/ and the suite
from lib.ragged_batches import table_batch  # noqa: E402

IMPLS = ("reference", "grouped")
HQ, HKV, D, BS, MAX_BLOCKS = 9, 3, 64, 16, 128
# name: (q_lens, kv_lens, T bucket, S bucket)
MICRO_CASES = {
    "prefill_512": ([512], [512], 512, 8),
    "prefill_512_after_512": ([512], [1024], 512, 8),
    "decode_8x512": ([1] * 8, [512] * 8, 16, 8),
    "decode_8x2048": ([1] * 8, [2048] * 8, 16, 8),
    "decode_64x512": ([1] * 64, [512] * 64, 64, 64),
    "decode_64x2048": ([1] * 64, [2048] * 64, 64, 64),
}
COMPILE_BUCKETS = ((16, 8), (64, 64), (512, 8), (512, 64))
DECODE = 128              # decode tokens per request of the decode workloads
# bench/throughput.py's engine, with half its pool (the workloads need < 1,300 blocks) so two
# engines fit beside each other
ENGINE = dict(dtype="float32", max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=512,
              num_kv_blocks=2049, seed=0)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def micro_batch(rng, q_lens, kv_lens, num_tokens, num_seqs):
    """One layer's inputs: q [T, 9, 64], pools [N, 16, 3, 64], block tables from a random
    permutation of the pool's blocks (padding sequences and tokens after the real ones)."""
    num_blocks = 2 + sum(-(-n // BS) for n in kv_lens)
    tables, lens, qsl = table_batch(rng, q_lens, kv_lens, T=num_tokens, S=num_seqs,
                                    max_blocks=MAX_BLOCKS, num_blocks=num_blocks, bs=BS)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    return (normal(num_tokens, HQ, D), normal(num_blocks, BS, HKV, D),
            normal(num_blocks, BS, HKV, D), tables, lens, qsl)


def run_micro(repeats: int) -> dict:
    rng = np.random.default_rng(0)
    fns = {impl: jax.jit(partial(paged_attention, impl=impl)) for impl in IMPLS}
    results = {}
    for name, (q_lens, kv_lens, t, s) in MICRO_CASES.items():
        args = micro_batch(rng, q_lens, kv_lens, t, s)
        outs = {impl: np.asarray(jax.block_until_ready(f(*args))) for impl, f in fns.items()}
        wall = {impl: [] for impl in IMPLS}
        cpu = {impl: [] for impl in IMPLS}
        before = load()
        for _ in range(2):                # blocks of repeats, alternated against load drift
            for impl, f in fns.items():
                for _ in range(repeats):
                    c, w = time.process_time(), time.perf_counter()
                    jax.block_until_ready(f(*args))
                    wall[impl].append(time.perf_counter() - w)
                    cpu[impl].append(time.process_time() - c)
        row = {"T": t, "S": s, "q_lens": sorted(set(q_lens)), "kv_lens": sorted(set(kv_lens)),
               "max_abs_diff": float(np.abs(outs["grouped"] - outs["reference"]).max()),
               "load_before": before, "load_after": load()}
        for impl in IMPLS:
            row[impl] = {"wall_ms_median": 1e3 * statistics.median(wall[impl]),
                         "wall_ms_min": 1e3 * min(wall[impl]),
                         "cpu_ms_median": 1e3 * statistics.median(cpu[impl])}
        row["speedup_wall_median"] = (row["reference"]["wall_ms_median"]
                                      / row["grouped"]["wall_ms_median"])
        row["speedup_cpu_median"] = (row["reference"]["cpu_ms_median"]
                                     / row["grouped"]["cpu_ms_median"])
        results[name] = row
        print(f"{name:24s} ref {row['reference']['wall_ms_median']:8.2f} ms  grouped "
              f"{row['grouped']['wall_ms_median']:7.2f} ms  x{row['speedup_wall_median']:.1f} "
              f"(cpu x{row['speedup_cpu_median']:.1f})  diff {row['max_abs_diff']:.1e}  "
              f"load {row['load_after']}", flush=True)
    return results


def run_compile() -> dict:
    """Seconds to compile the whole engine step of one (T, S) bucket with each impl, the
    persistent compilation cache off (it must not be on yet in this process)."""
    if jax.config.jax_compilation_cache_dir:
        raise RuntimeError("the persistent compilation cache is already on in this process")
    results = {}
    for impl in IMPLS:
        with LLM(attention_impl=impl, compilation_cache=False, **ENGINE) as llm:
            for t, s in COMPILE_BUCKETS:
                start = time.perf_counter()
                llm.engine.runner.compiled_step_text(t, s)
                results.setdefault(f"T{t}_S{s}", {})[impl] = time.perf_counter() - start
    for name, row in results.items():
        print(f"compile {name:10s} reference {row['reference']:5.1f} s  grouped "
              f"{row['grouped']:5.1f} s", flush=True)
    return {"seconds": results, "load_after": load()}


def austen_prompts(tokenizer, num_tokens: int) -> list[list[int]]:
    """The opening ``num_tokens`` tokens of a chapter in the middle of each novel."""
    prompts = []
    for book in BOOKS:
        text = austen(book)
        ids = tokenizer.encode(text[len(text) // 2:])
        prompts.append(ids[:num_tokens])
    return prompts


def run_parity(prompt_tokens: int, max_tokens: int) -> dict:
    """Greedy outputs of each impl; where they differ, the fp32 top-2 margin at that token."""
    outs = {}
    for impl in IMPLS:
        with LLM(attention_impl=impl, **ENGINE) as llm:
            prompts = austen_prompts(llm.tokenizer, prompt_tokens)
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=2)
            outs[impl] = [o.outputs[0] for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    rows = []
    for i, (ref, new) in enumerate(zip(outs["reference"], outs["grouped"])):
        diff = next((j for j, (a, b) in enumerate(zip(ref.token_ids, new.token_ids)) if a != b),
                    None)
        margins = [a - b for a, b in (sorted(lp.values(), reverse=True)[:2]
                                      for lp in ref.logprobs)]
        row = {"prompt": i, "tokens": len(ref.token_ids), "identical": diff is None,
               "reference_min_top2_margin": min(margins)}
        if diff is not None:
            row.update(first_difference=diff, reference_top2_margin=margins[diff])
        rows.append(row)
    same = sum(r["identical"] for r in rows)
    print(f"parity: {same}/{len(rows)} prompts token-identical over {max_tokens} tokens "
          f"(prompts {prompt_tokens} tokens; smallest fp32 top-2 margin on the way "
          f"{min(r['reference_min_top2_margin'] for r in rows):.4f})", flush=True)
    return {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "prompts": rows,
            "identical": same == len(rows)}


def e2e_workloads(tokenizer, seed: int = 0) -> dict:
    """name -> (prompts, output lengths): prompts cut from Pride and Prejudice."""
    ids = tokenizer.encode(austen("pride_and_prejudice"))
    rng = np.random.default_rng(seed)

    def cut(n, lo, hi):
        lens = rng.integers(lo, hi + 1, size=n)
        starts = rng.integers(0, len(ids) - hi, size=n)
        return [ids[s:s + p] for s, p in zip(starts, lens)]

    long, short = cut(8, 512, 512), cut(64, 64, 64)
    return {"prefill_8x512": (long, [1] * 8), "decode_8x512": (long, [1 + DECODE] * 8),
            "prefill_64x64": (short, [1] * 64), "decode_64x64": (short, [1 + DECODE] * 64),
            "mixed_32": (cut(32, 32, 512), [int(o) for o in rng.integers(16, 129, size=32)])}


def timed(llm, prompts, olens) -> tuple[float, list[list[int]]]:
    """Seconds to generate every request (prefix cache reset first) and the output tokens."""
    sps = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in olens]
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def run_e2e(repeats: int) -> dict:
    """Both engines alive at once; per workload: a first run of each (compiles its buckets),
    then ``repeats`` rounds of one run per impl (interleaved against load drift), medians.
    prefill tok/s = prompt tokens / prefill run; decode tok/s = the decode run's ``DECODE``
    tokens per request / (decode run - prefill run)."""
    results = {impl: {} for impl in IMPLS}
    tokens = {impl: {} for impl in IMPLS}
    with contextlib.ExitStack() as stack:
        llms = {impl: stack.enter_context(LLM(attention_impl=impl, **ENGINE)) for impl in IMPLS}
        work = e2e_workloads(llms["reference"].tokenizer)
        for name, (prompts, olens) in work.items():
            first = {impl: timed(llm, prompts, olens)[0] for impl, llm in llms.items()}
            runs = {impl: [] for impl in IMPLS}
            for _ in range(repeats):
                for impl, llm in llms.items():
                    elapsed, tokens[impl][name] = timed(llm, prompts, olens)
                    runs[impl].append(elapsed)
            for impl in IMPLS:
                results[impl][name] = {"first_run_s": first[impl], "runs_s": runs[impl],
                                       "median_s": statistics.median(runs[impl])}
                print(f"{impl:9s} {name:14s} first {first[impl]:6.1f} s, runs "
                      f"{[round(r, 2) for r in runs[impl]]} s", flush=True)
            results.setdefault("load_after", {})[name] = load()
            print(f"  load {load()}", flush=True)
    for impl in IMPLS:
        row = results[impl]
        for n, size in (("8x512", 8), ("64x64", 64)):
            pre, dec = row[f"prefill_{n}"]["median_s"], row[f"decode_{n}"]["median_s"]
            row[f"prefill_{n}_tok_s"] = sum(map(len, work[f"prefill_{n}"][0])) / pre
            row[f"decode_{n}_tok_s"] = size * DECODE / (dec - pre)
        prompts, olens = work["mixed_32"]
        row["mixed_32_total_tok_s"] = (sum(map(len, prompts)) + sum(olens)) / \
            row["mixed_32"]["median_s"]
        row["mixed_32_output_tok_s"] = sum(olens) / row["mixed_32"]["median_s"]
    results["greedy_identical"] = {name: tokens["reference"][name] == tokens["grouped"][name]
                                   for name in work}
    results["speedup"] = {k: results["grouped"][k] / results["reference"][k]
                          for k in results["grouped"] if k.endswith("tok_s")}
    for k, x in results["speedup"].items():
        print(f"{k:24s} reference {results['reference'][k]:8.1f}  grouped "
              f"{results['grouped'][k]:8.1f}  x{x:.2f}", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("micro", "compile", "parity", "e2e"), action="append")
    ap.add_argument("--repeats", type=int, default=7, help="micro benchmark repeats (>= 5)")
    ap.add_argument("--e2e-repeats", type=int, default=2)
    ap.add_argument("--parity-prompt-tokens", type=int, default=256)
    ap.add_argument("--parity-tokens", type=int, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    parts = a.only or ["micro", "compile", "parity", "e2e"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "jax": jax.__version__, "backend": jax.default_backend()},
              "commit": commit,
              "command": "python3 bench/experiments/attention_cpu.py " + " ".join(sys.argv[1:]),
              "load_start": load()}
    if "micro" in parts:
        result["micro"] = run_micro(a.repeats)
    if "compile" in parts:                # before any engine turns the persistent cache on
        result["compile"] = run_compile()
    if "parity" in parts:
        result["parity"] = run_parity(a.parity_prompt_tokens, a.parity_tokens)
    if "e2e" in parts:
        result["e2e"] = run_e2e(a.e2e_repeats)
    result["load_end"] = load()
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
