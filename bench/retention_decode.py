"""Decode step time under SnapKV: the block mass computed at the prompt's end only, or every step.

SnapKV reads the attention mass per block once, to compress the prompt (jaxkv/retention/
snapkv.py). Since a7a379f a step computes that mass only when a sampling chunk wants it
(``Retention.wants_scores``; ``StepPlan.observe``), so SnapKV's decode steps run the plain
attention. This measures what that saves, on SmolLM2-135M fp32, greedy: ``--batch`` prompts of
``--prompt`` Austen tokens (*Emma*), ``--budget``-token SnapKV budget, ``--max-tokens`` generated;
the engine is stepped by hand, and a decode step is one taken when no request waits and
every running one has its prompt computed (so the prompts' chunked prefill is not in it); the
time per variant is the median of those steps. Variants, all in one engine process each, run interleaved ``--reps`` times (the
first round compiles):

* ``full``: no retention (every prompt token kept);
* ``snapkv``: the engine as it is;
* ``snapkv-every-step``: the rule before a7a379f (every sampling step computes the mass),
  ``SnapKVRetention.wants_scores`` patched to always answer yes.

The two SnapKV variants must give identical tokens (checked). The load average is recorded
beside each run::

    python3 bench/retention_decode.py --out bench/results/retention_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from jaxkv import LLM, SamplingParams
from jaxkv.retention import SnapKVRetention

AUSTEN = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen" / "emma.txt"
VARIANTS = ("full", "snapkv", "snapkv-every-step")


def decode_steps(llm: LLM, prompts, params) -> tuple[list[float], list[list[int]]]:
    """Runs ``prompts`` through ``llm``'s engine core step by step.

    Returns:
      (seconds of every decode-only step, the greedy token ids of each request in order).
    """
    core = llm.engine
    ids = [core.add_request(p, params) for p in prompts]
    times, tokens = [], {}
    while core.has_unfinished_requests():
        state = core.scheduler_state
        decoding = not state.waiting and all(
            state.requests[r].num_computed_tokens >= len(state.requests[r].request.prompt_token_ids)
            for r in state.running)
        t = time.perf_counter()
        outs = core.step()
        if decoding:
            times.append(time.perf_counter() - t)
        tokens.update({r: o.outputs[0].token_ids for r, o in outs.items() if o.finished})
    return times, [tokens[r] for r in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    engine = dict(model=a.model, max_model_len=a.prompt + a.max_tokens + 16,
                  max_num_seqs=a.batch, max_num_batched_tokens=512)
    wants = SnapKVRetention.wants_scores
    llms = {"full": LLM(**engine),
            "snapkv": LLM(**engine, kv_retention="snapkv", kv_budget_tokens=a.budget)}
    llms["snapkv-every-step"] = llms["snapkv"]   # the same engine, the rule patched per run
    ids = llms["full"].tokenizer.encode(AUSTEN.read_text(encoding="utf-8")[:400_000])
    prompts = [{"prompt_token_ids": ids[i * 2 * a.prompt:i * 2 * a.prompt + a.prompt]}
               for i in range(a.batch)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    runs = {v: [] for v in VARIANTS}
    tokens = {}
    try:
        for rep in range(a.reps + 1):
            for v in VARIANTS:
                SnapKVRetention.wants_scores = (
                    (lambda self, *args: True) if v == "snapkv-every-step" else wants)
                llm = llms[v]
                llm.reset_prefix_cache()
                load = os.getloadavg()[0]
                times, tokens[v] = decode_steps(llm, prompts, params)
                ms = 1e3 * statistics.median(times)
                if rep:   # round 0 compiles
                    runs[v].append(dict(decode_ms=ms, decode_steps=len(times),
                                        load_before=load, load_after=os.getloadavg()[0]))
                print(f"rep {rep} {v:18s} decode {ms:8.1f} ms/step over {len(times)} steps  "
                      f"load {load:.2f}", flush=True)
    finally:
        SnapKVRetention.wants_scores = wants
        for llm in {id(x): x for x in llms.values()}.values():
            llm.close()
    summary = {v: dict(median_ms=statistics.median(r["decode_ms"] for r in runs[v]),
                       min_ms=min(r["decode_ms"] for r in runs[v]),
                       max_ms=max(r["decode_ms"] for r in runs[v])) for v in VARIANTS}
    same = tokens["snapkv"] == tokens["snapkv-every-step"]
    print(json.dumps(summary, indent=1), "\nSnapKV tokens identical in both variants:", same)
    if a.out:
        a.out.write_text(json.dumps(dict(args=vars(a) | {"out": str(a.out)}, runs=runs,
                                         summary=summary, snapkv_tokens_identical=same),
                                    indent=1))
    if not same:
        raise SystemExit("the two SnapKV variants gave different tokens")


if __name__ == "__main__":
    main()
