"""What a verify step's logits width costs: the jitted step at several widths W, same shape.

A step that verifies drafts computes ``W = 1 + num_speculative_tokens`` logit rows per sequence
(jaxkv/runner/batch.py), however short the step's drafts are: the LM head, the rejection sampler and
the attention's trailing rows all scale with ``W``. This times the engine's own jitted step
(``ModelRunner._blind_step_fn``, the step of every decode without a retention policy) on
all-padding arguments (``ModelRunner._padded_args``: every slot the null block's, contexts
empty, so attention over the cache costs nothing and what is left is the width-dependent
rest) for each batch size ``S`` (``--batches``) at the token bucket that holds ``S x max(W)``
tokens, at every width of ``--widths``, and the plain decode step (``S`` tokens' bucket,
``W = 1``) beside them when its bucket is smaller. After one compiling call each,
``--repeats`` back-to-back calls per variant in blocks alternating over ``--rounds`` rounds
(bench/lib/step_timing.py); median and min ms, and the load average. SmolLM2-135M-Instruct fp32
on CPU.

    python3 bench/experiments/verify_width.py --batches 1,4,16,64 --widths 1,3,5,9 \
        --json bench/experiments/results/verify_width.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax

from jaxkv import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/, for lib/ and the suite
from lib.step_timing import alternating_times, loadavg, ms_summary  # noqa: E402

TOKEN_BUCKETS = (16, 64, 256, 1024)


def step_call(runner, t: int, s: int, w: int):
    """A call of ``runner``'s jitted step on padding of shape (t tokens, s sequences, width w)
    that threads the donated cache through and blocks on the sampled tokens."""
    args = runner._padded_args(t, s, w)

    def call():
        runner.cache, tokens, *_ = runner._blind_step_fn(runner.params, runner.cache, *args,
                                                         num_logprobs=0)
        jax.block_until_ready(tokens)
    return call


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--widths", default="1,3,5,9")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    widths = [int(w) for w in a.widths.split(",")]
    out = {"machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "rounds": a.rounds, "repeats": a.repeats, "batches": {}}
    print("| S | tokens | variant | ms median (min) | load |\n|---|---|---|---|---|")
    for s in map(int, a.batches.split(",")):
        t = next(b for b in TOKEN_BUCKETS if b >= s * max(widths))
        llm = LLM(a.model, dtype="float32", max_num_seqs=s, max_model_len=1024,
                  max_num_batched_tokens=TOKEN_BUCKETS[-1], token_buckets=TOKEN_BUCKETS,
                  seq_buckets=(s,), speculative="ngram", num_speculative_tokens=max(widths) - 1)
        runner = llm.engine.runner
        plain = next(b for b in TOKEN_BUCKETS if b >= s)
        calls = {f"T={plain}, W=1 (plain decode)": step_call(runner, plain, s, 1)}
        calls |= {f"T={t}, W={w}": step_call(runner, t, s, w) for w in widths
                  if (t, w) != (plain, 1)}
        for call in calls.values():
            call()   # compiles
        load0 = loadavg()
        times = alternating_times(calls, a.rounds, a.repeats)
        load1 = loadavg()
        rows = {name: ms_summary(x) for name, x in times.items()}
        out["batches"][s] = {"tokens": t, "load_before": load0, "load_after": load1,
                             "variants": rows}
        for name, row in rows.items():
            print(f"| {s} | {t} | {name} | {row['ms_median']:.1f} ({row['ms_min']:.1f}) | "
                  f"{load0[0]:.2f}-{load1[0]:.2f} |", flush=True)
        llm.close()
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
