"""What KV-aware routing buys: a multi-tenant workload through NVIDIA Dynamo's frontend in front
of jaxkv workers, with the KV router, with round-robin, and with one worker.

Workload: ``--tenants`` system prompts (``--system-tokens`` tokens of Austen each), ``--requests``
requests, each a random tenant's system prompt plus its own short question, sent as streamed
completions at Poisson arrivals (``--rate`` per second), ``--max-tokens`` greedy tokens each.
Each worker's KV pool holds ``--pool-blocks`` blocks: fewer than all the tenants' prompts, as a
real deployment's caches are smaller than its tenants' prefixes; a router that keeps each
tenant on one worker lets two pools hold twice as many prompts. Every configuration starts
fresh processes (empty caches), warms up on unrelated prompts of the same shapes, then runs the
same requests at the same arrival times.

Reported per configuration: the prefix-cache hit rate of each worker (prompt tokens found
cached / prompt tokens, the workers' ``vllm:prefix_cache_*`` counters), TTFT p50 / p99 (client
side, first streamed token), requests/s and output tokens/s over the run, and the load average.

    python bench/kv_routing.py --out bench/results/kv_routing.json    # Dynamo's Python

Needs Dynamo (``pip install 'jaxkv[dynamo]'``, docs/dynamo.md) and the ``openai`` client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository, for bench.lib

from bench.lib.dynamo_cluster import DynamoCluster  # noqa: E402

CONFIGS = {"kv": (2, "kv"), "round-robin": (2, "round-robin"), "one worker": (1, "round-robin")}


def workload(a) -> tuple[list[str], list[tuple[float, str]], list[str]]:
    """(system prompts, [(arrival s, prompt)], warm-up prompts), seeded."""
    from jaxkv.data import austen

    text, rng = austen("emma"), random.Random(a.seed)
    chars = a.system_tokens * 4   # ~4 characters a token in Austen's English
    starts = rng.sample(range(0, len(text) - chars, chars), a.tenants + 8)
    systems = [f"Tenant {i}. " + text[s:s + chars] for i, s in enumerate(starts[:a.tenants])]
    t, requests = 0.0, []
    for j in range(a.requests):
        t += rng.expovariate(a.rate)
        requests.append((t, f"{rng.choice(systems)}\n\nQuestion {j}: who speaks next?"))
    warm = [f"Warm-up {i}. " + text[s:s + chars] + "\n\nQuestion: who?"
            for i, s in enumerate(starts[a.tenants:])]
    return systems, requests, warm


async def one(client, model: str, prompt: str, max_tokens: int, t0: float) -> dict:
    sent = time.perf_counter()
    first, tokens = None, 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    return {"ttft": (first or done) - sent, "sent": sent - t0, "done": done - t0,
            "tokens": tokens}


async def drive(cluster, requests, warm, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="-", max_retries=0,
                                timeout=600)
    model = cluster.models()[0]
    t0 = time.perf_counter()
    for i in range(0, len(warm), 2):   # in pairs: the router spreads them over the workers
        await asyncio.gather(*(one(client, model, p, max_tokens, t0) for p in warm[i:i + 2]))
    before = [cluster.worker_metrics(i) for i in range(len(cluster.system_ports))]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()

    async def at(arrival, prompt):
        await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - t0)))
        return await one(client, model, prompt, max_tokens, t0)

    results = await asyncio.gather(*(at(t, p) for t, p in requests))
    wall = max(r["done"] for r in results)
    after = [cluster.worker_metrics(i) for i in range(len(cluster.system_ports))]
    await client.close()
    return {"results": results, "wall_s": wall, "workers": [worker_delta(b, a) for b, a in
                                                             zip(before, after)],
            "load": [round(load, 2), round(os.getloadavg()[0], 2)]}


def worker_delta(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in ("vllm:prefix_cache_queries_total",
                                           "vllm:prefix_cache_hits_total",
                                           "vllm:prompt_tokens_total")}
    q = d["vllm:prefix_cache_queries_total"]
    return {"prompt_tokens": int(q), "hit_tokens": int(d["vllm:prefix_cache_hits_total"]),
            "hit_rate": d["vllm:prefix_cache_hits_total"] / q if q else None}


def summary(run: dict) -> dict:
    ttft = sorted(r["ttft"] for r in run["results"])
    p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))]
    q = sum(w["prompt_tokens"] for w in run["workers"])
    return {"hit_rate_per_worker": [w["hit_rate"] for w in run["workers"]],
            "hit_rate": sum(w["hit_tokens"] for w in run["workers"]) / q if q else None,
            "prompt_tokens_per_worker": [w["prompt_tokens"] for w in run["workers"]],
            "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": p99,
            "req_per_s": len(ttft) / run["wall_s"],
            "out_tok_per_s": sum(r["tokens"] for r in run["results"]) / run["wall_s"],
            "wall_s": run["wall_s"], "load": run["load"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="of: " + ", ".join(CONFIGS))
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--pool-blocks", type=int, default=96, help="each worker's KV blocks")
    p.add_argument("--router-args", default="",
                   help="extra frontend flags for the kv configuration, e.g. "
                        "'--router-kv-overlap-score-credit 2'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    _, requests, warm = workload(a)
    worker_args = ["--max-model-len", "1024", "--max-num-seqs", "8",
                   "--num-gpu-blocks-override", str(a.pool_blocks)]
    report = {"args": vars(a), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "commit": commit(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "configs": {}}
    for name in a.configs.split(","):
        workers, mode = CONFIGS[name]
        t = time.monotonic()
        extra = a.router_args.split() if mode == "kv" else []
        with DynamoCluster(workers=workers, router_mode=mode, worker_args=worker_args,
                           frontend_args=extra) as c:
            started = time.monotonic() - t
            run = asyncio.run(drive(c, requests, warm, a.max_tokens))
        report["configs"][name] = {**summary(run), "start_s": started, "runs": run}
        s = report["configs"][name]
        print(f"{name:12s} hit {fmt(s['hit_rate'])} per worker "
              f"{[fmt(h) for h in s['hit_rate_per_worker']]}  TTFT p50 {s['ttft_p50_s']:.2f} s "
              f"p99 {s['ttft_p99_s']:.2f} s  {s['req_per_s']:.3f} req/s "
              f"{s['out_tok_per_s']:.2f} tok/s  load {s['load']}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


def commit() -> str:
    """HEAD's short hash, ``+dirty`` with uncommitted changes."""
    import subprocess

    git = ["git", "-C", str(Path(__file__).resolve().parents[1])]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    return head + ("+dirty" if dirty.stdout.strip() else "")


def fmt(x) -> str:
    return "-" if x is None else f"{x:.1%}"


if __name__ == "__main__":
    sys.exit(main())
