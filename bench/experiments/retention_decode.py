"""Decode step time under KV retention: full, H2O and SnapKV, optionally against an older attention.

SnapKV reads the attention mass per block once, to compress the prompt (jaxkv/retention/
snapkv.py). Since a7a379f a step computes that mass only when a sampling chunk wants it
(``Retention.wants_scores``; ``StepPlan.observe``), so SnapKV's decode steps run the plain
attention; H2O computes it every step. Since 48bc36d the grouped attention and the block mass
visit only a sequence's kept blocks (jaxkv/attention/grouped.py, ``visited_chunks``), so a
sequence H2O or SnapKV thinned costs its kept KV, not its logical length. This measures both,
on SmolLM2-135M fp32, greedy: ``--batch`` prompts of ``--prompt`` Austen tokens (*Emma*), a
``--budget``-token H2O / SnapKV budget, ``--max-tokens`` generated; the engine is stepped by hand,
and a decode step is one taken when no request waits and every running one has its prompt
computed (so the prompts' chunked prefill is not in it); the time per variant is the median of
those steps. Variants (``--variants``), one engine each, run interleaved ``--reps`` times (the
first round compiles):

* ``full``: no retention (every prompt token kept);
* ``h2o``, ``snapkv``: the engine as it is;
* ``snapkv-every-step``: the rule before a7a379f (every sampling step computes the mass),
  ``SnapKVRetention.wants_scores`` patched to always answer yes (shares ``snapkv``'s engine);
* ``X@before`` (with ``--before REV``): variant ``X`` whose step runs
  ``jaxkv/attention/grouped.py`` and ``jaxkv/attention/mass.py`` as they were at git revision
  ``REV`` (loaded from ``git show``; patched into ``jaxkv.attention.dispatch`` and
  ``jaxkv.model.llama`` while that engine compiles and runs).

Variants of one policy must give identical tokens, or the bench says which differ. The load
average is recorded beside each run::

    python3 bench/experiments/retention_decode.py \
        --out bench/experiments/results/retention_decode.json
    python3 bench/experiments/retention_decode.py --prompt 2048 --before 903d4cc \
        --variants full,full@before,h2o,h2o@before,snapkv,snapkv@before \
        --out bench/experiments/results/retention_decode_kept.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import time
import types
from pathlib import Path

from jaxkv import LLM, SamplingParams
from jaxkv.attention import dispatch
from jaxkv.data import austen
from jaxkv.model import llama
from jaxkv.retention import SnapKVRetention

AUSTEN_BOOK = "emma"
VARIANTS = "full,snapkv,snapkv-every-step"


def old_attention(rev: str) -> dict:
    """``{paged_attention_grouped, block_attention_mass}`` of git revision ``rev``."""
    fns = {}
    for mod, fn in (("attention_grouped", "paged_attention_grouped"),
                    ("attention_mass", "block_attention_mass")):
        src = subprocess.run(["git", "show", f"{rev}:jaxkv/{mod}.py"], check=True,
                             capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[2]).stdout
        m = types.ModuleType(f"{mod}_at_{rev}")
        exec(compile(src, f"{rev}:jaxkv/{mod}.py", "exec"), m.__dict__)
        fns[fn] = getattr(m, fn)
    return fns


@contextlib.contextmanager
def attention_of(fns: dict | None):
    """The step traced inside runs ``fns`` (``old_attention``) instead of today's (None)."""
    if fns is None:
        yield
        return
    saved = dispatch.paged_attention_grouped, llama.block_attention_mass
    dispatch.paged_attention_grouped = fns["paged_attention_grouped"]
    llama.block_attention_mass = fns["block_attention_mass"]
    try:
        yield
    finally:
        dispatch.paged_attention_grouped, llama.block_attention_mass = saved


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
    ap.add_argument("--variants", default=VARIANTS, help="comma-separated (see the docstring)")
    ap.add_argument("--before", help="git revision of the attention of the X@before variants")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    variants = a.variants.split(",")
    old = old_attention(a.before) if a.before else None
    engine = dict(model=a.model, max_model_len=a.prompt + a.max_tokens + 16,
                  max_num_seqs=a.batch, max_num_batched_tokens=512)
    policy = {"full": {}, "h2o": dict(kv_retention="h2o", kv_budget_tokens=a.budget),
              "snapkv": dict(kv_retention="snapkv", kv_budget_tokens=a.budget)}
    wants = SnapKVRetention.wants_scores
    llms = {}
    for v in variants:
        name, _, at = v.partition("@")
        base = "snapkv" if name == "snapkv-every-step" else name
        key = (base, at)
        if key not in llms:
            with attention_of(old if at else None):
                llms[key] = LLM(**engine, **policy[base])
    tokenizer = next(iter(llms.values())).tokenizer
    ids = tokenizer.encode(austen(AUSTEN_BOOK)[:400_000])
    prompts = [{"prompt_token_ids": ids[i * 2 * a.prompt:i * 2 * a.prompt + a.prompt]}
               for i in range(a.batch)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    runs = {v: [] for v in variants}
    tokens = {}
    try:
        for rep in range(a.reps + 1):
            for v in variants:
                name, _, at = v.partition("@")
                SnapKVRetention.wants_scores = (
                    (lambda self, *args: True) if name == "snapkv-every-step" else wants)
                llm = llms[("snapkv" if name == "snapkv-every-step" else name, at)]
                llm.reset_prefix_cache()
                load = os.getloadavg()[0]
                with attention_of(old if at else None):
                    times, tokens[v] = decode_steps(llm, prompts, params)
                ms = 1e3 * statistics.median(times)
                if rep:   # round 0 compiles
                    runs[v].append(dict(decode_ms=ms, decode_steps=len(times),
                                        load_before=load, load_after=os.getloadavg()[0]))
                print(f"rep {rep} {v:18s} decode {ms:8.1f} ms/step over {len(times)} steps  "
                      f"load {load:.2f}", flush=True)
    finally:
        SnapKVRetention.wants_scores = wants
        for llm in llms.values():
            llm.close()
    summary = {v: dict(median_ms=statistics.median(r["decode_ms"] for r in runs[v]),
                       min_ms=min(r["decode_ms"] for r in runs[v]),
                       max_ms=max(r["decode_ms"] for r in runs[v])) for v in variants}
    # variants of one policy (snapkv and snapkv-every-step, X and X@before) give one output
    groups = {}
    for v in variants:
        groups.setdefault(v.partition("@")[0].replace("-every-step", ""), []).append(v)
    same = {g: all(tokens[v] == tokens[vs[0]] for v in vs) for g, vs in groups.items()}
    print(json.dumps(summary, indent=1), "\ntokens identical within each policy:", same)
    if a.out:
        a.out.write_text(json.dumps(dict(args=vars(a) | {"out": str(a.out)}, runs=runs,
                                         summary=summary, tokens_identical=same,
                                         tokens=tokens), indent=1))
    if not all(same.values()):
        raise SystemExit(f"variants of one policy gave different tokens: {same}")


if __name__ == "__main__":
    main()
