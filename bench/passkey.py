"""Passkey retrieval (needle in a haystack) on SmolLM2-135M: full cache, StreamingLLM, Quest, H2O,
SnapKV and random eviction, accuracy against the KV bytes one decode step reads.

    python bench/passkey.py --out bench/results/passkey.json [--lengths 4096 7680] [--runs full/int4 quest-512/int4 ...]

Each prompt (the protocol of Mohtashami & Jaggi's landmark attention, used by LongLoRA and
Quest) is an instruction, Jane Austen filler (a different stretch of Pride and Prejudice per
seed) with one sentence ``The pass key is 71432. Remember it. 71432 is the pass key.`` at a
relative depth, and the question ``What is the pass key? The pass key is``; exactly
``--lengths`` tokens, pieces tokenized separately and concatenated as token ids. Greedy, 8 new
tokens; a prompt counts as retrieved when the first number in the output is the key.
5 depths x 4 seeds per length.

Configurations (``--configs``, each one engine): ``full`` (dense), ``streaming-B``
(``kv_retention="streaming"``, 4 sinks + a window of B - 4 positions: the prefill too sees only
that), ``quest-B`` (``sparse_attention="quest"``, budget B tokens with 4 sinks and 32 recent
positions forced; prefill dense, every decode token attends to its B-token selection),
``h2o-B`` / ``random-B`` (``kv_retention="h2o"`` / ``"random"``, ``kv_budget_tokens=B``: 4
sinks, a recent window of B / 2, the rest heavy hitters / random blocks; prefill dense, eviction
from the first decode on), ``snapkv-B`` (``kv_retention="snapkv"``: the prompt compressed once, at
the end of prefill, to B tokens: 4 sinks, the 32-token observation window, the blocks its
attention ranks highest; question-aware, as the window ends the prompt, which ends with the
question; run one sequence at a time so the prompt's last chunk holds the whole window), each
in fp32 and int4 (KIVI) KV.

Teacher-forced configurations (``tf-KIND[-B]``, KIND one of ``full``, ``snapkv``,
``snapkv_agnostic``, ``h2o``, ``random``) run ``jaxkv.entrypoints.eval.retained_nll`` on the prompt
followed by the key's tokens (`` NNNNN``); a prompt counts as retrieved when the argmax at every key
position is the key's token (greedy would write exactly the key). ``snapkv_agnostic`` is SnapKV
with the observation window placed *before* the question: the prompt phase is the instruction
and haystack only (its last 32 tokens score the blocks), compressed to B, then the question and
the key are fed through the compressed cache; ``snapkv`` here is the question-aware variant on
the same footing (prompt phase = the whole prompt).

KV bytes read per decode step are counted analytically at the prompt's length L, per layer and
kv head, from the pool's exact array sizes (``KVCacheSpec.block_arrays``: codes, scales, zero
points), summed over layers and kv heads:

    full       cdiv(L, bs) pages x page bytes (K + V)
    streaming  the pages holding the 4 sinks and the last B - 4 positions x page bytes
    h2o, random, snapkv   min(B // bs, cdiv(L, bs)) pages x page bytes (the budget's pages:
               SnapKV's compressed prompt; the few generated tokens' page not counted)
    quest      cdiv(L, bs) x score bytes  +  min(budget pages, cdiv(L, bs)) x the rest of a
               page's bytes (score bytes: kmin/kmax f32 per channel, 2 x 4 D, beside a
               float pool's page; for a KIVI pool its own per-channel K scale and zero point,
               2 x 2 D, which scoring reads for every page and the selected pages then need
               no more)

and reported against the full cache's bytes in the same KV format and in fp32 / bf16.

    python bench/passkey.py --out bench/results/passkey.json --table   # the markdown table
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from jaxkv import LLM, SamplingParams
from jaxkv.data import austen
from jaxkv.entrypoints.eval import retained_nll
from jaxkv.kvcache.spec import KVCacheSpec
from jaxkv.retention import FullRetention, H2ORetention, RandomRetention, SnapKVRetention

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
SINKS, RECENT, BLOCK = 4, 32, 16
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.\n\n")
QUESTION = "\n\nWhat is the pass key? The pass key is"
RETAINED = ("h2o", "snapkv", "random")
TF_POLICIES = dict(full=lambda b: FullRetention(),
                   h2o=lambda b: H2ORetention(budget_tokens=b, sink_tokens=SINKS),
                   random=lambda b: RandomRetention(budget_tokens=b, sink_tokens=SINKS),
                   snapkv=lambda b: SnapKVRetention(budget_tokens=b, sink_tokens=SINKS),
                   snapkv_agnostic=lambda b: SnapKVRetention(budget_tokens=b, sink_tokens=SINKS))


def filler_ids(tokenizer, seed: int, n: int) -> list[int]:
    """``n`` tokens of Pride and Prejudice from a seeded paragraph start on."""
    text = austen("pride_and_prejudice")
    starts = [m.end() for m in re.finditer(r"\n\n", text)]
    rng = np.random.default_rng(seed)
    start = starts[int(rng.integers(0, len(starts) // 2))]
    ids = tokenizer.encode(text[start:start + 12 * n], add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"filler of seed {seed} is too short")
    return ids[:n]


def passkey_prompt(tokenizer, length: int, depth: float, seed: int) -> tuple[list[int], str]:
    """(prompt token ids of exactly ``length`` tokens, the key)."""
    key = str(np.random.default_rng(1000 + seed).integers(10000, 100000))
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ",
                              add_special_tokens=False)
    intro = tokenizer.encode(INTRO)
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    hay = filler_ids(tokenizer, seed, length - len(intro) - len(needle) - len(question))
    at = int(round(depth * len(hay)))
    return intro + hay[:at] + needle + hay[at:] + question, key


def page_bytes(spec: KVCacheSpec) -> tuple[int, int]:
    """(K + V bytes of one page of one kv head in one layer, Quest score bytes of one page)."""
    heads = spec.num_kv_heads
    total = 0
    for axis in spec.axes:
        for shape, dt in spec.block_arrays(axis).values():
            if len(shape) == 4:       # pool-shaped: codes, scales, zero points
                total += int(np.prod(shape[1:])) * np.dtype(dt).itemsize // heads
    d = spec.head_dim
    score = 2 * 2 * d if spec.format.kivi else 2 * 4 * d
    return total, score


def bytes_read(spec: KVCacheSpec, num_layers: int, kind: str, budget: int, length: int) -> int:
    """KV bytes one decode step at kv length ``length`` reads (see the module docstring)."""
    page, score = page_bytes(spec)
    bs, pages = spec.block_size, -(-length // spec.block_size)
    if kind == "full":
        n = pages * page
    elif kind in RETAINED or kind == "snapkv_agnostic":
        n = min(budget // bs, pages) * page
    elif kind == "streaming":
        window = set(range(max(length - (budget - SINKS), 0) // bs, pages))
        n = len(window | set(range(-(-SINKS // bs)))) * page
    else:
        rest = page - score if spec.format.kivi else page
        n = min(-(-budget // bs), pages) * rest + pages * score
    return n * num_layers * spec.num_kv_heads


def smollm2_spec(kv: str, quest: bool) -> KVCacheSpec:
    """SmolLM2-135M's cache geometry (30 layers, 3 kv heads, head_dim 64) in format ``kv``."""
    return KVCacheSpec(num_layers=30, num_blocks=2, block_size=BLOCK, num_kv_heads=3,
                       head_dim=64, kv_cache_dtype=kv, key_bounds=quest)


def table(results: dict) -> str:
    """The markdown table of ``results`` (bytes recounted from the geometry)."""
    lines = ["| length | config | KV | passkey accuracy | vs full, same KV | KV MiB read per "
             "decode step | vs full, same KV | vs full fp32 | vs full bf16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for tag, r in results.items():
        kind, _, budget = r["config"].removeprefix("tf-").partition("-")
        spec = smollm2_spec(r["kv"], kind == "quest")
        n = bytes_read(spec, 30, kind, int(budget or 0), r["length"])
        full = bytes_read(smollm2_spec(r["kv"], False), 30, "full", 0, r["length"])
        f32 = bytes_read(smollm2_spec("fp32", False), 30, "full", 0, r["length"])
        full_tag = "tf-full" if r["config"].startswith("tf-") else "full"
        ref = results.get(f"{r['length']}/{full_tag}/{r['kv']}")
        rel = f"{r['accuracy'] / ref['accuracy']:.0%}" if ref and ref["accuracy"] else "-"
        lines.append(f"| {r['length']} | {r['config']} | {r['kv']} | "
                     f"{sum(x['ok'] for x in r['rows'])}/{len(r['rows'])} | {rel} | "
                     f"{n / 2**20:.2f} | {n / full:.1%} | {n / f32:.1%} | {2 * n / f32:.1%} |")
    return "\n".join(lines)


def engine_args(name: str, kv: str, max_len: int) -> dict:
    kind, _, budget = name.partition("-")
    kw = dict(kv_cache_dtype=kv, max_model_len=max_len, max_num_seqs=4, block_size=BLOCK,
              prefix_caching=None, kv_sink_tokens=SINKS)
    if kind == "streaming":
        kw.update(kv_retention="streaming", kv_window_tokens=int(budget) - SINKS)
    elif kind == "quest":
        kw.update(sparse_attention="quest", sparse_budget_tokens=int(budget),
                  sparse_recent_tokens=RECENT)
    elif kind in RETAINED:
        kw.update(kv_retention=kind, kv_budget_tokens=int(budget))
        if kind == "snapkv":   # one prompt at a time: its last chunk is a whole 2,048-token one
            kw.update(max_num_seqs=1)
    return kw


def teacher_forced(llm, name: str, kv: str, cases) -> list[dict]:
    """Rows of a ``tf-KIND[-B]`` configuration (see the module docstring) over ``cases``:
    (depth, seed, prompt ids, key)."""
    kind, _, budget = name.removeprefix("tf-").partition("-")
    policy = TF_POLICIES[kind](int(budget or 0))
    policy.check_block_size(BLOCK, 1 if kv in ("int4", "int2") else 0)
    question = len(llm.tokenizer.encode(QUESTION, add_special_tokens=False))
    rows = []
    for depth, seed, ids, key in cases:
        answer = llm.tokenizer.encode(" " + key, add_special_tokens=False)
        prompt = len(ids) - (question if kind == "snapkv_agnostic" else 0)
        res = retained_nll(llm.engine.runner, ids + answer, retention=policy,
                           kv_cache_dtype=kv, chunk=1, prompt_tokens=prompt)
        got = res.argmax[len(ids) - 1:len(ids) - 1 + len(answer)].tolist()
        rows.append(dict(depth=depth, seed=seed, key=key, argmax=got, ok=got == answer,
                         key_nll=float(res.nll[len(ids) - 1:].mean())))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--runs", nargs="+", default=[
        "full/int4", "quest-512/int4", "full/fp32", "quest-512/fp32", "streaming-512/fp32",
        "quest-256/int4", "quest-1024/int4", "streaming-512/int4", "quest-256/fp32",
        "quest-1024/fp32", "streaming-256/fp32", "streaming-1024/fp32"],
                    help="config/kv pairs, run in this order (results already in --out are "
                         "kept and skipped)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--table", action="store_true", help="print the table of --out and exit")
    args = ap.parse_args(argv)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.table:
        print(table(results))
        return 0
    for length in args.lengths:
        for run in args.runs:
            name, kv = run.split("/")
            tag = f"{length}/{name}/{kv}"
            if tag in results:
                continue
            tf = name.startswith("tf-")
            kw = engine_args("full" if tf else name, kv, length + 16)
            t0 = time.perf_counter()
            with LLM(**kw) as llm:
                cases = [(d, s, *passkey_prompt(llm.tokenizer, length, d, s))
                         for d in DEPTHS for s in range(args.seeds)]
                if tf:
                    rows = teacher_forced(llm, name, kv, cases)
                else:
                    outs = llm.generate([dict(prompt_token_ids=ids) for *_, ids, _ in cases],
                                        SamplingParams(max_tokens=8, temperature=0.0),
                                        use_tqdm=False)
                spec, layers = llm.engine.runner.kv_spec, llm.model_config.num_layers
            if not tf:
                rows = []
                for (depth, seed, ids, key), out in zip(cases, outs):
                    text = out.outputs[0].text
                    found = re.search(r"\d+", text)
                    rows.append(dict(depth=depth, seed=seed, key=key, text=text,
                                     ok=bool(found and found.group() == key)))
            kind, _, budget = name.removeprefix("tf-").partition("-")
            results[tag] = dict(
                length=length, config=name, kv=kv, rows=rows,
                accuracy=float(np.mean([r["ok"] for r in rows])),
                bytes_read=bytes_read(spec, layers, kind, int(budget or 0), length),
                full_bytes=bytes_read(spec, layers, "full", 0, length),
                seconds=time.perf_counter() - t0)
            print(f"{tag}: accuracy {results[tag]['accuracy']:.2f}, "
                  f"{results[tag]['bytes_read'] / 2**20:.2f} MiB "
                  f"({results[tag]['bytes_read'] / results[tag]['full_bytes']:.1%}), "
                  f"{results[tag]['seconds']:.0f} s", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
