"""Where bench/throughput.py's 128-request workload spends its time, step by step.

The workload of bench/peers.py's T (and bench/throughput.py): 128 Austen prompts of 32-512
tokens, 16-256 greedy output tokens each, all queued at once. It runs on SmolLM2-135M fp32 with
peers.py's limits (512 tokens per step, 256 sequences, max length 1024, a 65,536-token pool).
Every engine step's ``runner.execute`` (the device step and its transfers) is timed together
with the step's shape. The report splits the time into steps that carry a prefill chunk and
decode-only steps, and breaks the decode-only steps down by running sequences (ms per step, ms
per sequence, mean context).

    python3 bench/step_mix.py [--json bench/results/step_mix.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from jaxkv import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/, for lib/ and the suite
from lib.step_timing import loadavg  # noqa: E402
from throughput import workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

GGUF = ROOT / "models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
BANDS = ((1, 16), (16, 32), (32, 64), (64, 96), (96, 129))


def engine(**kwargs) -> LLM:
    """SmolLM2-135M fp32 with peers.py's limits for T (``kwargs``: more engine arguments)."""
    return LLM(str(GGUF), dtype="float32", seed=0, num_kv_blocks=65536 // 16 + 1,
               max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=256, **kwargs)


def add_workload(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Queues T's 128 requests (greedy, ``ignore_eos``) on ``llm``; returns (prompts, output
    lengths)."""
    prompts, olens = workload(llm.tokenizer, 128, 0, 32, 512, 16, 256)
    for p, o in zip(prompts, olens):
        llm.add_request({"prompt_token_ids": p},
                        SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
    return prompts, olens


def time_steps(llm: LLM) -> list[tuple[int, int, int, float]]:
    """Wraps ``llm``'s ``runner.execute`` (the device step and its transfers) to log (tokens,
    sequences, context tokens, seconds) of every step into the list it returns."""
    runner = llm.engine.runner
    execute, log = runner.execute, []

    def timed(plan, rows):
        t0 = time.perf_counter()
        out = execute(plan, rows)
        log.append((sum(len(s.token_ids) for s in plan.seqs), len(plan.seqs),
                    sum(s.start_pos + len(s.token_ids) for s in plan.seqs),
                    time.perf_counter() - t0))
        return out

    runner.execute = timed
    return log


def step_groups(log) -> list[tuple[str, np.ndarray]]:
    """(name, bool mask over the steps of ``log``): the steps with a prefill chunk, the
    decode-only ones, and those by band of running sequences."""
    tok, seqs = np.array(log)[:, :2].T
    prefill = tok > seqs                      # some sequence computes > 1 token: a prefill chunk
    groups = [("with a prefill chunk", prefill), ("decode only", ~prefill)]
    return groups + [(f"decode only, {lo}-{hi - 1} seqs", ~prefill & (seqs >= lo) & (seqs < hi))
                     for lo, hi in BANDS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    llm = engine()
    llm.warmup()
    log = time_steps(llm)
    load = loadavg()
    prompts, olens = add_workload(llm)
    t = time.perf_counter()
    while llm.has_unfinished_requests():
        llm.step()
    wall = time.perf_counter() - t
    x = np.array(log)
    tok, seqs, ctx, sec = x.T
    out = {"wall_s": wall, "steps": len(x), "execute_s": float(sec.sum()), "load_before": load,
           "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(olens), "groups": {}}
    print(f"wall {wall:.1f} s, {len(x)} steps, execute {sec.sum():.1f} s, load {load}")
    print("| steps | n | s | ms/step | seqs/step | ms/seq | context/seq |\n|---|---|---|---|---|---|---|")
    for name, m in step_groups(log):
        if not m.any():
            continue
        g = dict(n=int(m.sum()), s=float(sec[m].sum()), ms_per_step=1e3 * float(sec[m].mean()),
                 seqs_per_step=float(seqs[m].mean()),
                 ms_per_seq=1e3 * float(sec[m].sum() / seqs[m].sum()),
                 context_per_seq=float(ctx[m].sum() / seqs[m].sum()))
        out["groups"][name] = g
        print(f"| {name} | {g['n']} | {g['s']:.1f} | {g['ms_per_step']:.0f} | "
              f"{g['seqs_per_step']:.0f} | {g['ms_per_seq']:.2f} | {g['context_per_seq']:.0f} |")
    out["load_after"] = loadavg()
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
