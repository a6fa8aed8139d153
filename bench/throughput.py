"""Offline throughput: jaxkv continuous batching vs HF transformers static-batch ``generate``.

Same machine, same weights (both load the SmolLM2-135M GGUF), fp32, greedy, one process. The
workload: ``--num-prompts`` requests whose prompts are cut from an Austen novel (token lengths
uniform in [min, max]) and whose output lengths are uniform in [16, 256]; every request generates
exactly its length (``ignore_eos`` here, ``min_new_tokens`` there), so both produce the same
useful tokens. HF runs static batches of ``--hf-batch-size`` in input order, left-padded, each
batch generating the longest output of the batch (what a static batch must do); only each
request's own tokens count as useful output. The prefix cache is reset before every repeat, so
no repeat hits the previous one's prompts (each computes its whole workload).

Also measured, in the same run:
* KV utilization: live tokens / allocated slots of the paged pool, averaged over steps, against
  a contiguous reservation of ``max_model_len`` slots per running sequence.
* Host overhead: the share of step time spent outside the jitted step (scheduler, batch building,
  sampling tensors, detokenization), from a run with 256 running sequences.

    python3 bench/throughput.py --num-prompts 128 --repeats 3 --out bench/results/throughput.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from jaxkv import LLM, SamplingParams
from jaxkv.model import store
from jaxkv.data import austen



def workload(tokenizer, n, seed, min_prompt, max_prompt, min_out, max_out):
    text = austen("pride_and_prejudice")
    ids = tokenizer.encode(text)
    rng = np.random.default_rng(seed)
    plens = rng.integers(min_prompt, max_prompt + 1, size=n)
    starts = rng.integers(0, len(ids) - max_prompt, size=n)
    olens = rng.integers(min_out, max_out + 1, size=n)
    return [ids[s:s + p] for s, p in zip(starts, plens)], [int(o) for o in olens]


def run_jaxkv(llm, prompts, olens):
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in olens]
    used, live, reserved = [], [], []
    for p, sp in zip(prompts, params):
        llm.add_request({"prompt_token_ids": p}, sp)
    outs = {}
    t = time.perf_counter()
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                outs[o.request_id] = o
        s = llm.stats()
        if s["kv_blocks_used"]:
            used.append(s["kv_blocks_used"] * llm.cache_config.block_size)
            live.append(s["kv_tokens_live"])
            reserved.append(s["num_running"] * llm.sched_config.max_model_len)
    elapsed = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs.values())
    assert n_out == sum(olens), (n_out, sum(olens))
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_tokens_per_s": n_out / elapsed,
            "kv_utilization_paged": float(np.sum(live) / np.sum(used)),
            "kv_utilization_contiguous": float(np.sum(live) / np.sum(reserved)),
            "outputs": [outs[k].outputs[0].token_ids for k in sorted(outs, key=int)]}


def run_hf(model, prompts, olens, batch_size):
    import torch

    t = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), batch_size):
        ps, os_ = prompts[i:i + batch_size], olens[i:i + batch_size]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(os_),
                                 min_new_tokens=max(os_), do_sample=False, pad_token_id=0)
        outputs += [out[j, width:width + o].tolist() for j, o in enumerate(os_)]
    elapsed = time.perf_counter() - t
    n_out = sum(olens)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_tokens_per_s": n_out / elapsed,
            "outputs": outputs}


def host_overhead(llm, tokenizer, n=256, out=24):
    """Steps with ``n`` running sequences: share of step time spent on the host."""
    prompts, _ = workload(tokenizer, n, 7, 16, 32, out, out)
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    for p in prompts:
        llm.add_request({"prompt_token_ids": p}, params)
    while llm.stats()["num_running"] < n or llm.stats()["num_waiting"]:
        llm.step()                     # prefill every request first
    before = llm.stats()
    s0 = llm.stats()
    busy0, dev0 = s0["busy_time_s"], s0["device_time_s"]
    steps = 0
    while llm.stats()["num_running"] == n and steps < 8:
        llm.step()
        steps += 1
    s1 = llm.stats()
    busy, dev = s1["busy_time_s"] - busy0, s1["device_time_s"] - dev0
    while llm.has_unfinished_requests():
        llm.step()
    return {"running": n, "steps": steps, "step_s": busy / steps,
            "host_s_per_step": (busy - dev) / steps, "host_fraction": (busy - dev) / busy,
            "running_before": before["num_running"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-out", type=int, default=16)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    path = store.resolve(store.DEFAULT_MODEL)
    llm = LLM(str(path), dtype="float32", max_model_len=1024, max_num_seqs=256,
              max_num_batched_tokens=a.max_num_batched_tokens,
              num_kv_blocks=4097, seed=0)
    prompts, olens = workload(llm.tokenizer, a.num_prompts, 0, a.min_prompt, a.max_prompt,
                              a.min_out, a.max_out)
    t = time.perf_counter()
    llm.warmup()
    warm = time.perf_counter() - t
    hf = None
    if not a.skip_hf:
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
        run_hf(hf, prompts[:2], [4, 4], 2)                         # warm-up
    runs = {"jaxkv": [], "hf": []}
    for r in range(a.repeats):
        llm.reset_prefix_cache()   # every repeat computes its prompts (no hits on the last one's)
        jx = run_jaxkv(llm, prompts, olens)
        runs["jaxkv"].append(jx)
        print(f"repeat {r}: jaxkv {jx['output_tokens_per_s']:.1f} out tok/s "
              f"({jx['elapsed_s']:.1f} s)", flush=True)
        if hf is not None:
            h = run_hf(hf, prompts, olens, a.hf_batch_size)
            runs["hf"].append(h)
            agree = np.mean([x == y for x, y in zip(jx["outputs"], h["outputs"])])
            print(f"repeat {r}: HF    {h['output_tokens_per_s']:.1f} out tok/s "
                  f"({h['elapsed_s']:.1f} s); identical outputs {agree:.0%}", flush=True)
    llm.reset_prefix_cache()
    overhead = host_overhead(llm, llm.tokenizer)

    def summary(xs, key):
        v = [x[key] for x in xs]
        return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}

    result = {
        "machine": f"{platform.node()} {platform.machine()}, {__import__('os').cpu_count()} cores",
        "workload": vars(a),
        "warmup_s": warm,
        "jaxkv_output_tokens_per_s": summary(runs["jaxkv"], "output_tokens_per_s"),
        "kv_utilization_paged": summary(runs["jaxkv"], "kv_utilization_paged"),
        "kv_utilization_contiguous": summary(runs["jaxkv"], "kv_utilization_contiguous"),
        "host_overhead_256_running": overhead,
    }
    if runs["hf"]:
        result["hf_output_tokens_per_s"] = summary(runs["hf"], "output_tokens_per_s")
        ratios = [j["output_tokens_per_s"] / h["output_tokens_per_s"]
                  for j, h in zip(runs["jaxkv"], runs["hf"])]
        result["ratio_jaxkv_over_hf"] = {"median": statistics.median(ratios),
                                         "min": min(ratios), "max": max(ratios)}
        result["identical_outputs_fraction"] = float(np.mean(
            [x == y for x, y in zip(runs["jaxkv"][0]["outputs"], runs["hf"][0]["outputs"])]))
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
