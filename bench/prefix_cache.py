"""Prefix caching, forks and beam search: prefill saved, hit rates and blocks shared.

Scenarios (``--scenarios``, default all):

* ``article``: the seed article's case on the real SmolLM2-135M (fp32, CPU): 10 requests share a
  500-token system prompt plus their own question; the first runs alone, the other 9 arrive after
  it. Prefill tokens computed and mean TTFT of the 9, with caching off / hash / radix.
* ``chat``: an 8-turn chat on SmolLM2 re-sending its whole history each turn (chat template,
  greedy 24-token replies): prompt tokens computed per turn and the hit rate.
* ``few_shot``: 32 questions behind one 5-shot prefix (~420 tokens), queued at once (scheduler
  simulation, no model: hit rates and computed tokens do not depend on the weights).
* ``capacity``: hit rate against pool size, FCFS vs LPM, hash vs radix: 8 documents of 192 tokens,
  6 questions each, shuffled, queued at once (scheduler simulation).
* ``sharing``: peak KV blocks of ``n = 2/4/8`` parallel samples and beam widths 2/4/6 against no
  sharing, on the tests' tiny random Llama (bench/lib/random_model.py; n-sample counts do not
  depend on the weights, beam search's do).

    python3 bench/prefix_cache.py --out bench/results/prefix_cache.json
    python3 bench/prefix_cache.py --scenarios few_shot,capacity,sharing   # no real model, ~1 min

Results of scenarios run separately accumulate in the ``--out`` file.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from jaxkv import LLM, SamplingParams
from jaxkv.blocks.block_manager import cdiv
from jaxkv.config import CacheConfig, SchedulerConfig
from jaxkv.data import austen
from jaxkv.engine.beam_search import BeamSearchParams
from jaxkv.sched.scheduler import add_request, schedule, update
from jaxkv.sched.state import Request, StopSpec, init_state

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/, for lib/ and the suite
from lib.random_model import write_tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = (None, "hash", "radix")


def austen_ids(tokenizer, book="pride_and_prejudice.txt", n_chars=60_000):
    return tokenizer.encode(austen(book)[:n_chars])


def real_llm(mode, **kw):
    return LLM(prefix_caching=mode, dtype="float32", max_model_len=2048, max_num_seqs=16,
               max_num_batched_tokens=1024, token_buckets=(16, 64, 256, 1024), seq_buckets=(16,),
               num_kv_blocks=512, warmup=True, **kw)


def article(args):
    out = {}
    for mode in MODES:
        llm = real_llm(mode)
        ids = austen_ids(llm.tokenizer)
        system = ids[:500]
        questions = [ids[1000 + 37 * i:1000 + 37 * i + 12] for i in range(10)]
        greedy = SamplingParams(temperature=0, max_tokens=1)
        before = llm.stats()["num_computed_tokens"]
        first = llm.generate([{"prompt_token_ids": system + questions[0]}], greedy,
                             use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": system + q} for q in questions[1:]], greedy,
                            use_tqdm=False)
        s = llm.stats()
        out[str(mode)] = {
            "prompt_tokens": sum(len(system) + len(q) for q in questions),
            "prefill_tokens_computed": s["num_computed_tokens"] - before,
            "system_prompt_tokens_computed": s["num_computed_tokens"] - before
            - sum(len(q) for q in questions),
            "ttft_first_s": first[0].metrics.ttft,
            "ttft_mean_others_s": statistics.mean(o.metrics.ttft for o in rest),
            "num_cached_tokens_others": [o.num_cached_tokens for o in rest],
        }
        llm.close()
        print("article", mode, out[str(mode)], file=sys.stderr)
    base = out["None"]["prefill_tokens_computed"]
    shared = out["None"]["system_prompt_tokens_computed"]
    for mode in ("hash", "radix"):
        out[mode]["prefill_saved"] = 1 - out[mode]["prefill_tokens_computed"] / base
        out[mode]["system_prompt_prefill_saved"] = \
            1 - out[mode]["system_prompt_tokens_computed"] / shared
    return out


def chat(args):
    user_turns = ["Who is Elizabeth Bennet?", "And her sisters?", "Tell me about Mr. Darcy.",
                  "Why does she dislike him at first?", "What changes her mind?",
                  "Who is Wickham?", "How does the story end?", "Summarize it in one line."]
    out = {}
    for mode in MODES:
        llm = real_llm(mode)
        messages = [{"role": "system", "content": "You are a helpful literature tutor."}]
        turns = []
        greedy = SamplingParams(temperature=0, max_tokens=24)
        for text in user_turns:
            messages.append({"role": "user", "content": text})
            before = llm.stats()["num_computed_tokens"]
            (o,) = llm.chat(messages, greedy, use_tqdm=False)
            computed = llm.stats()["num_computed_tokens"] - before - (len(o.outputs[0].token_ids)
                                                                     - 1)
            turns.append({"prompt_tokens": len(o.prompt_token_ids),
                          "prompt_tokens_computed": computed,
                          "num_cached_tokens": o.num_cached_tokens, "ttft_s": o.metrics.ttft})
            messages.append({"role": "assistant", "content": o.outputs[0].text})
        s = llm.stats()
        out[str(mode)] = {"turns": turns,
                          "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
                          "prompt_tokens_computed": sum(t["prompt_tokens_computed"]
                                                        for t in turns),
                          "hit_rate": s["prefix_cache_hit_rate"]}
        llm.close()
        print("chat", mode, {k: v for k, v in out[str(mode)].items() if k != "turns"},
              file=sys.stderr)
    return out


def simulate(prompts, *, mode, policy="fcfs", num_blocks, block_size=16, max_num_seqs=8,
             budget=512, max_tokens=16):
    """Scheduler-only run (fixed sampled token): computed tokens and prefix hit rate."""
    cc = CacheConfig(block_size=block_size, num_blocks=num_blocks, prefix_caching=mode)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=4096, policy=policy)
    state = init_state(cc)
    for i, p in enumerate(prompts):
        state = add_request(state, Request(request_id=i, prompt_token_ids=p, arrival_time=i,
                                           stop=StopSpec(max_tokens=max_tokens)), sc)
    computed = lookups = hits = 0
    while state.requests:
        state, plan = schedule(state, sc)
        state = update(state, plan, [7] * len(plan.seqs))
        computed += plan.num_tokens
        lookups += plan.num_lookup_tokens
        hits += plan.num_hit_tokens
    return {"computed_tokens": computed, "hit_rate": hits / lookups if lookups else 0.0}


def few_shot(args, tokenizer):
    ids = austen_ids(tokenizer, "emma.txt")
    shots = ids[:420]
    prompts = [tuple(shots + ids[2000 + 20 * i:2000 + 20 * i + 14]) for i in range(32)]
    out = {}
    for mode in MODES:
        out[str(mode)] = simulate(prompts, mode=mode, num_blocks=1024)
        print("few_shot", mode, out[str(mode)], file=sys.stderr)
    return out


def capacity(args, tokenizer):
    ids = austen_ids(tokenizer, "sense_and_sensibility.txt")
    docs = [ids[400 * d:400 * d + 192] for d in range(8)]
    prompts = [tuple(docs[d] + ids[5000 + 29 * (6 * d + q):5000 + 29 * (6 * d + q) + 9])
               for d in range(8) for q in range(6)]
    random.Random(0).shuffle(prompts)
    rows = []
    for num_blocks in (40, 56, 80, 120, 200, 400):
        row = {"num_blocks": num_blocks}
        for mode in ("hash", "radix"):
            for policy in ("fcfs", "lpm"):
                r = simulate(prompts, mode=mode, policy=policy, num_blocks=num_blocks,
                             max_num_seqs=4)
                row[f"{mode}_{policy}_hit_rate"] = r["hit_rate"]
        rows.append(row)
        print("capacity", row, file=sys.stderr)
    return rows


def sharing(args, tiny_dir):
    bs, prompt_len, max_tokens = 16, 200, 64
    llm = LLM(str(tiny_dir), prefix_caching=None, dtype="float32", block_size=bs,
              max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256,
              token_buckets=(16, 64, 256), seq_buckets=(16,), num_kv_blocks=400)
    prompt = {"prompt_token_ids": [(7 * i) % 390 + 3 for i in range(prompt_len)]}

    def peak(fn):
        llm.engine.reset_peak_usage()
        fn()
        return round(llm.stats()["kv_usage_peak"] * llm.cache_config.num_usable_blocks)

    out = {"block_size": bs, "prompt_tokens": prompt_len, "max_tokens": max_tokens,
           "parallel_sampling": {}, "beam_search": {}}
    for n in (2, 4, 8):
        sp = SamplingParams(n=n, seed=0, max_tokens=max_tokens, ignore_eos=True)
        one = SamplingParams(seed=0, max_tokens=max_tokens, ignore_eos=True)
        shared = peak(lambda: llm.generate([prompt], sp, use_tqdm=False))
        alone = peak(lambda: llm.generate([prompt] * n, one, use_tqdm=False))
        out["parallel_sampling"][n] = {"blocks_shared": shared, "blocks_no_sharing": alone,
                                       "saved": 1 - shared / alone}
        print("n", n, out["parallel_sampling"][n], file=sys.stderr)
    for width in (2, 4, 6):
        shared = peak(lambda: llm.beam_search([prompt], BeamSearchParams(
            beam_width=width, max_tokens=max_tokens, ignore_eos=True)))
        alone = width * cdiv(prompt_len + max_tokens, bs)
        out["beam_search"][width] = {"blocks_shared": shared, "blocks_no_sharing": alone,
                                     "saved": 1 - shared / alone}
        print("beam", width, out["beam_search"][width], file=sys.stderr)
    llm.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default="article,chat,few_shot,capacity,sharing")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefix_cache.json"))
    args = ap.parse_args()
    scenarios = args.scenarios.split(",")
    result = {"machine": platform.platform(), "processor": platform.processor(),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    if "article" in scenarios:
        result["article"] = article(args)
    if "chat" in scenarios:
        result["chat"] = chat(args)
    if {"few_shot", "capacity"} & set(scenarios):
        from jaxkv.model.weights import load_model_files
        tokenizer = load_model_files("SmolLM2-135M-Instruct").tokenizer
        if "few_shot" in scenarios:
            result["few_shot"] = few_shot(args, tokenizer)
        if "capacity" in scenarios:
            result["capacity"] = capacity(args, tokenizer)
    if "sharing" in scenarios:
        import tempfile

        with tempfile.TemporaryDirectory() as tiny:
            write_tiny_llama(tiny)
            result["sharing"] = sharing(args, tiny)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():   # scenarios run separately accumulate in one file
        result = {**json.loads(out.read_text()), **result}
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
