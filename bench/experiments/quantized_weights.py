"""Weights kept quantized against dequantized (``"none"``), side by side in one process on the
default model (SmolLM2-135M Q4_1, a Q8_0 embedding): GGUF's blocks kept (``None``) and each
``--mode`` quantized at load (``int8``, ``fp8``, ``int4:GROUP``). The params' bytes read from
the arrays, the engine's decode step (``llm.step()`` wall time while every request decodes) at
a few batch sizes, and a prefill of 8 long prompts, the engines' measurements interleaved.

    python3 bench/experiments/quantized_weights.py --batch 1 --batch 8 --batch 32 --rounds 3 \
        [--mode None --mode int8 --mode fp8 --mode int4:64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax

from jaxkv import LLM, SamplingParams


def decode_ms(llm: LLM, batch: int, prompt: str, steps: int) -> float:
    """Median ms of ``llm.step()`` over ``steps`` steps in which all ``batch`` requests decode."""
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        llm.add_request(prompt, sp)
    for _ in range(4):                       # prefill (one chunk) and the first decode steps
        llm.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.step()
        times.append(1e3 * (time.perf_counter() - t))
    while llm.has_unfinished_requests():
        llm.step()
    return statistics.median(times)


def prefill_s(llm: LLM, prompts: list[str]) -> float:
    """Seconds to prefill ``prompts`` (one token generated each), prefix cache reset first."""
    llm.reset_prefix_cache()
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t


def engine_args(mode: str) -> dict:
    """``LLM`` arguments of a mode: ``None``, a ``quantization`` value, or ``int4:GROUP``."""
    if mode == "None":
        return dict(quantization=None)
    method, _, group = mode.partition(":")
    return dict(quantization=method, **({"quantization_group_size": int(group)} if group else {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mode", action="append", help="None, int8, fp8, int4:GROUP (repeatable)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    batches = a.batch or [1, 8, 32]
    prompt = "It is a truth universally acknowledged, that a single man in possession of a " * 3
    engines = {q: LLM(**engine_args(q), max_num_seqs=max(batches), max_model_len=512)
               for q in dict.fromkeys([*(a.mode or ["None"]), "none"])}
    out = {"loadavg_start": open("/proc/loadavg").read().split()[:3], "rows": []}
    for q, llm in engines.items():
        leaves = jax.tree_util.tree_leaves(llm.engine.runner.params)
        out[f"weight_bytes[{q}]"] = sum(x.nbytes for x in leaves)
        print(f"quantization={q!r}: params {out[f'weight_bytes[{q}]'] / 2**20:.1f} MiB; "
              f"{llm.memory_plan.headline()}")
        decode_ms(llm, max(batches), prompt, 4)             # compile every decode shape
        for b in batches:
            decode_ms(llm, b, prompt, 2)
    for b in batches:
        ms = {q: [] for q in engines}
        for _ in range(a.rounds):
            for q, llm in engines.items():
                ms[q].append(decode_ms(llm, b, prompt, a.steps))
        row = {"batch": b, **{f"ms[{q}]": min(v) for q, v in ms.items()}}
        out["rows"].append(row)
        print(f"batch {b:3d}: " + "   ".join(
            f"{q} {row[f'ms[{q}]']:7.2f} ms/step (x{row['ms[none]'] / row[f'ms[{q}]']:.2f})"
            for q in engines), flush=True)
    text = "It is a truth universally acknowledged, that a single man in possession of a good "
    prompts = [f"{i}: " + text * 24 for i in range(8)]              # ~8 x 430 tokens
    secs = {q: [] for q in engines}
    for _ in range(a.rounds + 1):                                   # the first run compiles
        for q, llm in engines.items():
            secs[q].append(prefill_s(llm, prompts))
    tokens = sum(len(engines["none"].tokenizer.encode(p)) for p in prompts)
    out["prefill"] = {"tokens": tokens, **{f"s[{q}]": min(v[1:]) for q, v in secs.items()}}
    print(f"prefill {tokens} tokens: " + ", ".join(
        f"{q} {out['prefill'][f's[{q}]']:.2f} s" for q in engines))
    out["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    print("loadavg", out["loadavg_start"], "->", out["loadavg_end"])
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
