"""The host KV tier (issue 14) on SmolLM2-135M: multi-turn replay and preemption by swap.

Workloads (``--workloads``, default both):

* ``multiturn``: 12 conversations x 4 turns; each turn sends the whole history plus ~500 new
  tokens of Austen (a user turn) and gets a 32-token greedy reply (the history then holds it
  too), all 12 conversations of a turn queued at once, turn after turn. Device pool of
  ``--pool-tokens`` (4K), so the histories (to ~2.1K tokens each) cannot all stay on the
  device; host tier of ``--host-tokens`` (32K). Prefix cache alone vs with the host tier:
  prompt tokens recomputed, TTFT p50 / p95, wall time, hits by tier, in all and per turn;
  outputs compared token by token.
* ``preempt``: 16 requests of 2K prompt + 512 generated tokens (greedy, ``ignore_eos``) queued at
  once into a pool that fits 6 whole sequences; ``preemption_mode`` recompute / swap / auto
  against an unconstrained pool (all 16 fit): tokens computed beyond the unconstrained run
  (recomputed), preemptions (by swap), makespan; outputs compared token by token. Prefix
  caching off, so recompute really recomputes (with it on, the preempted prompt's registered
  blocks would come back as hits).

* ``restart``: two engine processes, one after the other, on one ``kv_cache_dir`` (8 prompts
  of ``--prompt`` Austen tokens, 16 greedy tokens each): the second's prefix hits from disk,
  prompt tokens computed, TTFT, and its outputs against the first's.

    python3 bench/offload.py --out bench/results/offload.json          # ~30 min on 2 cores
    python3 bench/offload.py --workloads preempt --requests 8 --prompt 512 --output 128 --fit 3

Every engine warms up (``warmup=True``, a few buckets) before its timed run; each run's load
average is recorded before and after it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from jaxkv import LLM, SamplingParams
from jaxkv.data import austen

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16


def loadavg() -> float:
    return os.getloadavg()[0]


def engine(pool_tokens: int, max_len: int, seqs: int, **kw) -> LLM:
    return LLM(dtype="float32", max_model_len=max_len, max_num_seqs=seqs,
               max_num_batched_tokens=512, token_buckets=(16, 64, 512), seq_buckets=(16,),
               num_kv_blocks=pool_tokens // BLOCK + 1, warmup=True, **kw)


class StepLog:
    """Per-step log of an engine (``--step-log``): wraps ``ModelRunner.execute`` and records,
    per step, its kind (prefill / decode / mixed), tokens, running batch, waiting queue, the
    token bucket, step ms (the whole ``execute``: transfers, copies, the jitted step), and
    whether the step compiled a new shape (``ModelRunner.num_compilations`` grew)."""

    def __init__(self, llm: LLM, path: Path, buckets=(16, 64, 512)):
        self.rows, self.runner, self.buckets = [], llm.engine.runner, buckets
        self.file, self.t0 = path.open("w"), time.perf_counter()   # a line per step, as it runs
        self.core = llm.engine
        execute = self.runner.execute

        def logged(plan, rows):
            c0, t0 = self.runner.num_compilations(), time.perf_counter()
            out = execute(plan, rows)
            ms = (time.perf_counter() - t0) * 1e3
            n = plan.num_tokens
            decodes = sum(len(s.token_ids) == 1 and s.sample for s in plan.seqs)
            kind = ("decode" if decodes == len(plan.seqs) else
                    "prefill" if decodes == 0 else "mixed")
            st = self.core.scheduler_state
            self.rows.append({
                "t": time.perf_counter(), "kind": kind, "tokens": n, "seqs": len(plan.seqs),
                "decodes": decodes, "waiting_before": len(st.waiting),
                "bucket": next((b for b in self.buckets if b >= n), n), "ms": round(ms, 1),
                "compiled": self.runner.num_compilations() > c0,
                "preempted": len(plan.preempted_ids), "free_blocks_before":
                    st.block_manager.num_free_blocks})
            self.file.write(json.dumps(self.rows[-1] | {
                "t": round(self.rows[-1]["t"] - self.t0, 2)}) + "\n")
            self.file.flush()
            return out

        self.runner.execute = logged

    def summary(self, start: int = 0) -> dict:
        """Steps, tokens and seconds by kind and bucket, and the compiling steps, of the steps
        logged from the ``start``-th on."""
        out, rows = {}, self.rows[start:]
        for r in rows:
            k = f"{r['kind']}@{r['bucket']}"
            d = out.setdefault(k, {"steps": 0, "tokens": 0, "s": 0.0, "seqs": 0})
            d["steps"] += 1
            d["tokens"] += r["tokens"]
            d["s"] += r["ms"] / 1e3
            d["seqs"] += r["seqs"]
        for d in out.values():
            d["mean_ms"] = round(d["s"] * 1e3 / d["steps"], 1)
            d["mean_seqs"] = round(d.pop("seqs") / d["steps"], 2)
            d["s"] = round(d["s"], 1)
        out["compiling_steps"] = [r for r in rows if r["compiled"]]
        return out


def austen_ids(tokenizer, n_tokens: int) -> list[int]:
    text = "".join(austen(b)
                   for b in ("pride_and_prejudice.txt", "emma.txt"))
    ids = tokenizer.encode(text[:n_tokens * 6])
    if len(ids) < n_tokens:
        raise ValueError(f"the Austen text gives {len(ids)} tokens, {n_tokens} needed")
    return ids[:n_tokens]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def turn_record(s: dict, s0: dict, wall: float, ttft: list[float], fresh: int) -> dict:
    """One multi-turn turn from the engine stats after (``s``) and before (``s0``) it: wall,
    TTFTs (sorted, each from the turn's start: all 12 requests are queued at once), prompt tokens
    computed and recomputed (``fresh``: the turn's tokens never seen before), hits by tier."""
    d = {k: s.get(k, 0) - s0.get(k, 0) for k in (
        "num_computed_tokens", "num_generated_tokens", "prefix_cache_hits",
        "prefix_cache_hits_host", "num_preemptions")}
    prefill = d["num_computed_tokens"] - (d["num_generated_tokens"] - len(ttft))
    return {"wall_s": wall, "ttft_s": sorted(ttft), "prompt_tokens_computed": prefill,
            "prompt_tokens_recomputed": prefill - fresh, "prefix_hit_tokens":
            d["prefix_cache_hits"], "host_hit_tokens": d["prefix_cache_hits_host"],
            "num_preemptions": d["num_preemptions"]}


def multiturn(args) -> dict:
    out, texts = {}, {}
    host_bytes = None
    tiers = ("prefix cache only", "prefix cache + host tier")
    for tier in [tiers[i] for i in map(int, args.tiers.split(","))]:
        kw = {}
        if tier.endswith("host tier"):
            kw = dict(kv_offload_bytes=host_bytes)
        llm = engine(args.pool_tokens, min(2400, args.pool_tokens), 12, **kw)
        if host_bytes is None:   # the host tier holds --host-tokens tokens of all-layer blocks
            c = llm.engine.model_config
            unit = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * BLOCK
            host_bytes = args.host_tokens // BLOCK * unit
            if kw:   # the tier's engine came first (--tiers 1): build it again with its tier
                llm.close()
                llm = engine(args.pool_tokens, min(2400, args.pool_tokens), 12,
                             kv_offload_bytes=host_bytes)
        log = None if args.step_log is None else StepLog(llm, args.step_log.with_name(
            f"{args.step_log.stem}_{len(texts)}.jsonl"))
        ids = austen_ids(llm.tokenizer, 12 * args.turns * args.turn_tokens + 1000)
        reply = SamplingParams(temperature=0, max_tokens=args.reply_tokens, ignore_eos=True)
        histories = [[] for _ in range(12)]
        ttft, replies, sent, turns = [], [], 0, []
        load0, s0, t0 = loadavg(), llm.stats(), time.perf_counter()
        for turn in range(args.turns):
            st, tt = llm.stats(), time.perf_counter()
            i0 = 0 if log is None else len(log.rows)
            prompts = []
            for c in range(12):
                start = (turn * 12 + c) * args.turn_tokens
                histories[c] = histories[c] + ids[start:start + args.turn_tokens]
                prompts.append(list(histories[c]))
                sent += len(histories[c])
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], reply,
                               use_tqdm=False)
            for c, r in enumerate(res):
                histories[c] += r.outputs[0].token_ids
                ttft.append(r.metrics.ttft)
                replies.append(r.outputs[0].token_ids)
            turns.append(turn_record(llm.stats(), st, time.perf_counter() - tt,
                                     [r.metrics.ttft for r in res],
                                     12 * args.turn_tokens + 12 * (turn > 0)))
            if log is not None:   # this turn's steps, by kind and token bucket
                turns[-1]["steps"] = log.summary(i0)
            print(f"multiturn [{tier}] turn {turn + 1}/{args.turns} done", file=sys.stderr)
        wall = time.perf_counter() - t0
        s = llm.stats()
        computed = s["num_computed_tokens"] - s0["num_computed_tokens"]
        generated = s["num_generated_tokens"] - s0["num_generated_tokens"]
        n_requests = 12 * args.turns
        prefill = computed - (generated - n_requests)   # a reply's last token is not computed
        fresh = 12 * args.turns * args.turn_tokens + 12 * (args.turns - 1)   # never seen before
        out[tier] = {
            "wall_s": wall, "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
            "prompt_tokens_sent": sent,
            "prompt_tokens_computed": prefill,
            "prompt_tokens_recomputed": prefill - fresh,
            "prefix_hit_tokens": s["prefix_cache_hits"] - s0["prefix_cache_hits"],
            "host_hit_tokens": s.get("prefix_cache_hits_host", 0),
            "kv_offload_bytes_out": s.get("kv_offload_bytes_out", 0),
            "kv_offload_bytes_in": s.get("kv_offload_bytes_in", 0),
            "copy_GBps": [None if x is None else x / 1e9 for x in
                          (s.get("kv_offload_d2h_bytes_per_s"),
                           s.get("kv_offload_h2d_bytes_per_s"))],
            "load_before_after": [load0, loadavg()],
            "per_turn": turns,
        }
        if log is not None:
            out[tier]["steps"] = log.summary()
            log.file.close()
        texts[tier] = replies
        llm.close()
        print("multiturn", tier, out[tier], file=sys.stderr)
    if len(texts) < 2:
        return out
    a, b = texts.values()
    out["identical_replies"] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
    return out


def preempt(args) -> dict:
    out, texts = {}, {}
    total = args.prompt + args.output
    runs = [("unconstrained", args.requests * total, {}),
            ("recompute", args.fit * total, dict(preemption_mode="recompute")),
            ("swap", args.fit * total, dict(preemption_mode="swap")),
            ("auto", args.fit * total, dict(preemption_mode="auto"))]
    runs = [r for r in runs if r[0] == "unconstrained" or r[0] in args.modes.split(",")]
    host_bytes = None
    for name, pool, kw in runs:
        if kw:
            kw = dict(kw, kv_offload_bytes=host_bytes)
        llm = engine(pool, total + BLOCK, args.requests, prefix_caching=None, **kw)
        if host_bytes is None:
            c = llm.engine.model_config
            unit = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * BLOCK
            host_bytes = args.requests * (total // BLOCK + 1) * unit
        ids = austen_ids(llm.tokenizer, args.requests * args.prompt)
        prompts = [ids[i * args.prompt:(i + 1) * args.prompt] for i in range(args.requests)]
        params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
        load0, t0 = loadavg(), time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        s = llm.stats()
        out[name] = {"makespan_s": wall, "num_computed_tokens": s["num_computed_tokens"],
                     "num_preemptions": s["num_preemptions"],
                     "num_swap_preemptions": s.get("num_swap_preemptions", 0),
                     "kv_offload_bytes_out": s.get("kv_offload_bytes_out", 0),
                     "prefill_tokens_per_s_fitted": s.get("prefill_tokens_per_s"),
                     "copy_GBps": [None if x is None else x / 1e9 for x in
                                   (s.get("kv_offload_d2h_bytes_per_s"),
                                    s.get("kv_offload_h2d_bytes_per_s"))],
                     "pool_tokens": pool, "load_before_after": [load0, loadavg()]}
        texts[name] = [r.outputs[0].token_ids for r in res]
        llm.close()
        print("preempt", name, out[name], file=sys.stderr)
    base = out["unconstrained"]["num_computed_tokens"]
    for name in out:
        out[name]["tokens_recomputed"] = out[name]["num_computed_tokens"] - base
        out[name]["identical_to_unconstrained"] = (
            f"{sum(x == y for x, y in zip(texts[name], texts['unconstrained']))}/{args.requests}")
    return out


def restart_child(args) -> None:
    """One engine process over ``--cache-dir``: 8 prompts of ``--prompt`` Austen tokens, 16
    greedy tokens each; prints a JSON line (outputs, TTFTs, disk hits and files)."""
    llm = engine(4096, args.prompt + 32, 8, kv_offload_bytes=1 << 30,
                 kv_cache_dir=str(args.cache_dir))
    ids = austen_ids(llm.tokenizer, 8 * args.prompt)
    prompts = [ids[i * args.prompt:(i + 1) * args.prompt] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    s = llm.stats()
    llm.close()
    print(json.dumps({"outputs": [r.outputs[0].token_ids for r in res], "wall_s": wall,
                      "ttft_p50_s": pct([r.metrics.ttft for r in res], 0.5),
                      "disk_hit_tokens": s["prefix_cache_hits_disk"],
                      "prompt_tokens_computed": s["num_computed_tokens"] - 8 * 15,
                      "disk_files_after_close": llm.stats()["kv_disk_blocks"]}))


def restart(args) -> dict:
    """Two engine processes, one after the other, on one fresh ``kv_cache_dir``."""
    import subprocess
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as d:
        for run in ("first process", "second process"):
            load0 = loadavg()
            proc = subprocess.run([sys.executable, __file__, "--restart-child", d,
                                   "--prompt", str(args.prompt)], capture_output=True,
                                  text=True, check=True)
            out[run] = json.loads(proc.stdout.strip().splitlines()[-1])
            out[run]["load_before_after"] = [load0, loadavg()]
            print("restart", run, {k: v for k, v in out[run].items() if k != "outputs"},
                  file=sys.stderr)
    a, b = (out[r].pop("outputs") for r in ("first process", "second process"))
    out["identical_outputs"] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="multiturn,preempt,restart")
    ap.add_argument("--pool-tokens", type=int, default=4096, help="multiturn: device pool")
    ap.add_argument("--host-tokens", type=int, default=32768, help="multiturn: host tier")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tiers", default="0,1",
                    help="multiturn: 0 = prefix cache only, 1 = with the host tier")
    ap.add_argument("--turn-tokens", type=int, default=500)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=16, help="preempt: requests")
    ap.add_argument("--prompt", type=int, default=2048, help="preempt: prompt tokens")
    ap.add_argument("--output", type=int, default=512, help="preempt: generated tokens")
    ap.add_argument("--fit", type=int, default=6, help="preempt: whole sequences the pool fits")
    ap.add_argument("--modes", default="recompute,swap,auto",
                    help="preempt: preemption modes run beside the unconstrained pool")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--step-log", type=Path, help="multiturn: write each step (kind, tokens, "
                    "batch, bucket, ms, compiled) to <stem>_<run>.jsonl and summarise per turn")
    ap.add_argument("--restart-child", type=Path, dest="cache_dir",
                    help="(internal) run one restart-workload engine over this kv_cache_dir")
    args = ap.parse_args()
    if args.cache_dir is not None:
        return restart_child(args)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    for w in args.workloads.split(","):
        result[w] = {"multiturn": multiturn, "preempt": preempt, "restart": restart}[w](args)
        print(json.dumps({w: result[w]}, indent=1))
        if args.out:
            prev = json.loads(args.out.read_text()) if args.out.exists() else {}
            args.out.write_text(json.dumps(prev | result, indent=1))


if __name__ == "__main__":
    main()
