"""The physical floor of the peers' workloads on this machine, and where each engine stands (issue 16).

A whole pass of a peers.py workload (bench/peers.py: same requests, greedy, fixed output
lengths) does a fixed amount of fp32 arithmetic and memory traffic, whatever the engine:

* dense FLOPs: every token through the decoder (each request's prompt and all its outputs but
  the last) costs ``2 x`` the decoder layers' weights (q, k, v, o, gate, up, down);
* head FLOPs: one row of the tied head (``2 x E x V``) per generated token;
* attention FLOPs: a token at position ``t`` scores and mixes ``t + 1`` keys, ``4 x Hq x D`` a
  key and layer;
* memory: the weights once per step (steps at least ``tokens / 512`` and the longest output),
  the KV written once and read by each decode token (its whole context) and once per prompt.

This measures the machine's fp32 FMA peak and its read bandwidth (``bench/pass_floor.c``, built
here with ``gcc -O3 -march=native``: 12 accumulators a thread; a 1 GiB buffer summed, best of
five) on one and two threads, and gives each workload's compute time at the two-thread peak, its
memory time at the two-thread bandwidth, and the floor (the larger: no engine can beat either).
With ``--peers`` (a peers.py result), each engine's pass time (output tokens / its median tok/s)
as a multiple of the floor, and what ``jaxkv / vLLM best = 1.2`` would ask of jaxkv.

    PYTHONPATH=. python3 bench/pass_floor.py --peers bench/results/peers_s34.json \\
        --json bench/results/pass_floor_s34.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxkv.model.gguf import config_from_gguf, open_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/, for lib/ and the suite
from peers import GGUF, LIMITS, WORKLOADS, loadavg, make_workloads  # noqa: E402


def machine_limits() -> dict:
    """The FMA peak (GFLOP/s) and read bandwidth (GB/s) on 1 and 2 threads."""
    src = Path(__file__).with_suffix(".c")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "pass_floor"
        subprocess.run(["gcc", "-O3", "-march=native", "-pthread", str(src), "-o", str(exe)],
                       check=True)
        out = {}
        for kind in ("fma", "read"):
            for threads in (1, 2):
                runs = [float(subprocess.run([str(exe), kind, str(threads)], check=True,
                                             capture_output=True, text=True).stdout)
                        for _ in range(3)]
                out[f"{kind}_{threads}t"] = max(runs)
    return out


def pass_work(cfg, prompts: list[list[int]], olens: list[int]) -> dict:
    """The arithmetic and memory traffic of one pass over (prompts, olens), in FLOPs and bytes."""
    E, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer_params = E * Hq * D + 2 * E * Hkv * D + Hq * D * E + 3 * E * F
    kv_token = L * 2 * Hkv * D * 4                                   # bytes of one token's KV
    tokens = attn_keys = decode_kv = prompt_kv = 0
    for p, o in zip(map(len, prompts), olens):
        n = p + o - 1                                                # tokens fed to the model
        tokens += n
        attn_keys += n * (n + 1) // 2
        decode_kv += sum(t + 1 for t in range(p, n)) * kv_token      # each decode token's context
        prompt_kv += p * kv_token
    steps = max(-(-tokens // LIMITS["max_num_batched_tokens"]), max(olens))
    weight_bytes = (L * layer_params + E * V) * 4
    return {"tokens": tokens, "output_tokens": sum(olens), "min_steps": steps,
            "dense_flops": 2 * L * layer_params * tokens,
            "head_flops": 2 * E * V * sum(olens),
            "attention_flops": 4 * Hq * D * L * attn_keys,
            "weight_bytes": weight_bytes * steps,
            "kv_bytes": decode_kv + prompt_kv + tokens * kv_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="A,T,L", help="comma list of peers.py's workloads")
    ap.add_argument("--peers", help="a peers.py result JSON: each engine against the floor")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    names = a.workloads.split(",")
    for n in names:
        if n not in WORKLOADS:
            ap.error(f"unknown workload {n!r}")
    load = [loadavg()]
    lim = machine_limits()
    load.append(loadavg())
    print(f"FMA peak {lim['fma_1t']:.1f} GFLOP/s on 1 thread, {lim['fma_2t']:.1f} on 2; read "
          f"{lim['read_1t']:.1f} GB/s on 1 thread, {lim['read_2t']:.1f} on 2 (load "
          f"{load[0][0]:.2f}-{load[1][0]:.2f})\n")
    cfg = config_from_gguf(open_gguf(GGUF))
    peers = json.loads(Path(a.peers).read_text()) if a.peers else None
    res = {"limits": lim, "load": load, "workloads": {}}
    print("| workload | tokens | GFLOP dense / head / attention | GB weights / KV | compute s "
          "| memory s | floor s |")
    print("|---|---|---|---|---|---|---|")
    wl = make_workloads(names)
    for n in names:
        w = pass_work(cfg, wl[n]["prompts"], wl[n]["olens"])
        flops = w["dense_flops"] + w["head_flops"] + w["attention_flops"]
        w["compute_s"] = flops / (lim["fma_2t"] * 1e9)
        w["memory_s"] = (w["weight_bytes"] + w["kv_bytes"]) / (lim["read_2t"] * 1e9)
        w["floor_s"] = max(w["compute_s"], w["memory_s"])
        res["workloads"][n] = w
        print(f"| {n} | {w['tokens']:,} | {w['dense_flops'] / 1e9:,.0f} / "
              f"{w['head_flops'] / 1e9:,.0f} / {w['attention_flops'] / 1e9:,.0f} | "
              f"{w['weight_bytes'] / 1e9:,.1f} / {w['kv_bytes'] / 1e9:,.1f} | "
              f"{w['compute_s']:.1f} | {w['memory_s']:.1f} | {w['floor_s']:.1f} |")
    if peers:
        print("\n| workload | engine | out tok/s (median) | pass s | pass / floor |")
        print("|---|---|---|---|---|")
        for n in names:
            w, best = res["workloads"][n], None
            for e, r in peers["engines"].items():
                if "error" in r or n not in r["workloads"]:
                    continue
                tok_s = r["workloads"][n]["summary"]["median"]
                pass_s = w["output_tokens"] / tok_s
                w.setdefault("engines", {})[e] = {"tok_s": tok_s, "pass_s": pass_s,
                                                  "pass_over_floor": pass_s / w["floor_s"]}
                print(f"| {n} | {e} | {tok_s:.1f} | {pass_s:.1f} | {pass_s / w['floor_s']:.2f} |")
                if r["config"]["kind"] == "vllm" and r["config"]["precision"] == "fp32":
                    best = max(best or 0, tok_s)
            if best:
                need = w["output_tokens"] / (1.2 * best)
                w["target_1_2"] = {"pass_s": need, "pass_over_floor": need / w["floor_s"]}
                print(f"| {n} | jaxkv at 1.2 x vLLM best | {1.2 * best:.1f} | {need:.1f} | "
                      f"{need / w['floor_s']:.2f} |")
        res["peers"] = {"file": a.peers, "command": peers.get("command"),
                        "jaxkv_commit": peers.get("jaxkv_commit")}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
