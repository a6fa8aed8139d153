"""StreamingLLM on SmolLM2-135M: perplexity past the model's context with a 1,024-token cache,
decode step time against context length, and how many 8K-token streams a fixed pool holds.

    python bench/streaming.py --out bench/results/streaming.json --plot bench/results/streaming.png

1. Perplexity (StreamingLLM's protocol, ``jaxkv.entrypoints.eval.retained_nll``): ``--tokens`` tokens of
   concatenated Austen (*Emma*, then *Pride and Prejudice*, ...) fed in ``--chunk``-token steps
   through a pool that keeps only what the policy keeps (blocks leaving the window go back):

   * dense: full attention over the first ``--dense-tokens`` tokens (the model's context is
     8,192: positions beyond it are out of distribution);
   * window only: the last 1,024 positions, no sinks (expected to collapse once the first
     tokens leave the cache);
   * sinks S = 1, 2, 4, 8 + a window of 1,024 - S, positions within the cache (StreamingLLM);
   * sinks 4 + window 1,020 at the original positions;
   * sliding window with re-computation (the oracle): every ``--oracle-every``-th token from
     1,024 on, scored after a fresh forward of the 1,023 tokens before it (no sinks, no cache
     reuse).

   Per row: perplexity over all scored tokens, per 1K-token segment (plotted), and the pool
   blocks the sequence held at most.
2. Decode step time with ``LLM`` (batch 1, greedy): prompt of L tokens (L = 1K ... 8,000), then
   ``--decode-tokens`` tokens; median time per output token of the decode steps, full retention
   vs streaming (sinks 4 + window 1,020), ``--repeats`` runs each.
3. Capacity: the pure scheduler (no model) with the pool ``--pool-gib`` GiB of SmolLM2 fp32 KV
   buys, ``--streams`` requests of 8,192 tokens (64-token prompt + 8,128 generated): how many
   run at once (median over steps), the makespan in steps and the preemptions, under full
   retention vs streaming; every one runs to its end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxkv import LLM, SamplingParams
from jaxkv.data import austen
from jaxkv.entrypoints.eval import retained_nll
from jaxkv.retention import FullRetention, StreamingRetention

BOOKS = ("emma.txt", "pride_and_prejudice.txt", "sense_and_sensibility.txt", "mansfield_park.txt")
CACHE = 1024


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def austen_ids(tokenizer, n: int) -> np.ndarray:
    """The first ``n`` tokens of the concatenated books."""
    ids: list[int] = []
    for book in BOOKS:
        ids += tokenizer.encode(austen(book))
        if len(ids) >= n:
            break
    return np.asarray(ids[:n], np.int32)


def segments(nll: np.ndarray, positions: np.ndarray | None = None, size: int = 1000
             ) -> list[dict]:
    """Perplexity per ``size``-token segment of the text, by the scored tokens' ``positions``
    (default ``0, 1, ...``)."""
    pos = np.arange(len(nll)) if positions is None else positions
    out = []
    for a in range(0, int(pos[-1]) + 1, size):
        sel = (pos >= a) & (pos < a + size)
        if sel.any():
            out.append({"start": a, "ppl": float(np.exp(nll[sel].mean())), "n": int(sel.sum())})
    return out


def perplexity_rows(llm, ids, args) -> list[dict]:
    runner = llm.engine.runner
    configs = [("dense (full attention)", FullRetention(), args.dense_tokens),
               ("window only (0 + 1024)", StreamingRetention(sink_tokens=0,
                                                             window_tokens=CACHE), None)]
    configs += [(f"sinks {s} + window {CACHE - s}",
                 StreamingRetention(sink_tokens=s, window_tokens=CACHE - s), None)
                for s in (1, 2, 4, 8)]
    configs.append(("sinks 4 + window 1020, original positions",
                    StreamingRetention(sink_tokens=4, window_tokens=CACHE - 4,
                                       positions="original"), None))
    rows = []
    for name, policy, limit in tqdm(configs, desc="perplexity"):
        text = ids if limit is None else ids[:limit + 1]
        res = retained_nll(runner, text, retention=policy, kv_cache_dtype="fp32",
                           chunk=args.chunk)
        rows.append({"config": name, "tokens": len(res.nll), "ppl": res.perplexity,
                     "ppl_after_8k": float(np.exp(res.nll[8192:].mean()))
                     if len(res.nll) > 8192 else None,
                     "ppl_at_oracle_positions": float(np.exp(res.nll[oracle_positions(
                         len(ids), args)].mean())) if limit is None else None,
                     "peak_blocks": res.peak_blocks, "pool_blocks": res.pool_blocks,
                     "seconds": res.seconds, "segments": segments(res.nll),
                     "loadavg": loadavg()})
        print(f"{name}: ppl {res.perplexity:.3f} over {len(res.nll)} tokens, "
              f"{res.peak_blocks} blocks held at most, {res.seconds:.0f} s", flush=True)
    return rows


def oracle_positions(n_ids: int, args) -> np.ndarray:
    """Scored positions i (predicting token i + 1) of the recompute oracle."""
    return np.arange(CACHE, n_ids - 1, args.oracle_every)


def oracle_row(llm, ids, args) -> dict:
    """Sliding window with re-computation: token i + 1 after a fresh forward of the 1,023
    tokens ending at i (no sinks, nothing reused)."""
    runner = llm.engine.runner
    positions = oracle_positions(len(ids), args)
    nll = np.empty(len(positions))
    t0 = time.perf_counter()
    for j, i in enumerate(tqdm(positions, desc="recompute oracle")):
        window = ids[i - CACHE + 1:i + 2]                 # 1,024 context tokens + the target
        nll[j] = retained_nll(runner, window, retention=FullRetention(), kv_cache_dtype="fp32",
                              chunk=256).nll[-1]
    return {"config": "sliding window + recompute (oracle)", "tokens": len(nll),
            "ppl": float(np.exp(nll.mean())), "ppl_at_oracle_positions": float(np.exp(nll.mean())),
            "every": args.oracle_every, "seconds": time.perf_counter() - t0,
            "segments": segments(nll, positions), "loadavg": loadavg()}


def decode_rows(args) -> list[dict]:
    rows = []
    for name, kw in (("full", {}), ("streaming 4 + 1020",
                                    dict(kv_retention="streaming", kv_sink_tokens=4,
                                         kv_window_tokens=CACHE - 4))):
        with LLM(max_model_len=8192, max_num_seqs=1, max_num_batched_tokens=512,
                 prefix_caching=None, **kw) as llm:
            ids = austen_ids(llm.tokenizer, max(args.contexts) + 1)
            for ctx in args.contexts:
                times = []
                for _ in range(args.repeats):
                    core = llm.engine
                    core.add_request({"prompt_token_ids": ids[:ctx].tolist()},
                                     SamplingParams(temperature=0, max_tokens=args.decode_tokens,
                                                    ignore_eos=True))
                    steps = []
                    while core.has_unfinished_requests():
                        t = time.perf_counter()
                        core.step()
                        steps.append(time.perf_counter() - t)
                    times.append(statistics.median(steps[-(args.decode_tokens - 2):]))
                rows.append({"retention": name, "context": ctx,
                             "decode_ms_median": 1e3 * statistics.median(times),
                             "decode_ms_runs": [round(1e3 * t, 2) for t in times],
                             "loadavg": loadavg()})
                print(rows[-1], flush=True)
    return rows


def capacity_rows(args) -> list[dict]:
    """Concurrent 8K-token streams the pure scheduler runs in one pool (no model)."""
    from jaxkv.config import CacheConfig, SchedulerConfig
    from jaxkv.model.weights import load_config
    from jaxkv.runner.memory_plan import kv_bytes_per_block
    from jaxkv.sched.scheduler import add_request, schedule, update
    from jaxkv.sched.state import Request, StopSpec, init_state

    config = load_config("SmolLM2-135M-Instruct")
    bs = 16
    num_blocks = int(args.pool_gib * 2**30) // kv_bytes_per_block(config, "fp32", bs, 1, None)
    rows = []
    for name, policy in (("full", FullRetention()),
                         ("streaming 4 + 1020", StreamingRetention(sink_tokens=4,
                                                                   window_tokens=CACHE - 4))):
        cc = CacheConfig(block_size=bs, num_blocks=num_blocks, retention=policy)
        sc = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=8192)
        state = init_state(cc)
        for i in range(args.streams):
            state = add_request(state, Request(request_id=i, prompt_token_ids=tuple(range(64)),
                                               stop=StopSpec(max_tokens=8128, ignore_eos=True)),
                                sc)
        running, preempted = [], 0
        while state.requests:
            state, plan = schedule(state, sc)
            preempted += len(plan.preempted_ids)
            running.append(len(state.running))
            state = update(state, plan, [7] * len(plan.seqs))
        rows.append({"retention": name, "pool_gib": args.pool_gib, "pool_blocks": num_blocks,
                     "streams": args.streams, "median_running": statistics.median(running),
                     "most_running": max(running), "steps": len(running),
                     "preemptions": preempted})
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/streaming.json")
    ap.add_argument("--plot", default="bench/results/streaming.png")
    ap.add_argument("--tokens", type=int, default=20_480)
    ap.add_argument("--dense-tokens", type=int, default=12_288)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--oracle-every", type=int, default=200)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool-gib", type=float, default=1.0)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--parts", nargs="+", default=["ppl", "oracle", "decode", "capacity"])
    args = ap.parse_args()

    out = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "args": vars(args),
           "loadavg_start": loadavg()}
    if "ppl" in args.parts or "oracle" in args.parts:
        with LLM(max_model_len=1024, max_num_seqs=1) as llm:
            ids = austen_ids(llm.tokenizer, args.tokens + 1)
            out["ppl"] = perplexity_rows(llm, ids, args) if "ppl" in args.parts else []
            if "oracle" in args.parts:
                out["ppl"].append(oracle_row(llm, ids, args))
    if "decode" in args.parts:
        out["decode"] = decode_rows(args)
    if "capacity" in args.parts:
        out["capacity"] = capacity_rows(args)
    out["loadavg_end"] = loadavg()
    Path(args.out).write_text(json.dumps(out, indent=1))
    if out.get("ppl") and args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 5))
        for row in out["ppl"]:
            seg = row["segments"]
            ax.plot([s["start"] + 500 for s in seg], [s["ppl"] for s in seg], marker=".",
                    label=row["config"])
        ax.axvline(8192, color="grey", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("token position (1K-token segments)")
        ax.set_ylabel("perplexity")
        ax.set_title("SmolLM2-135M on Austen, 1,024-token cache")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
