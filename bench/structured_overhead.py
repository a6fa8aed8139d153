"""What structured outputs cost (issue 54): one engine, the same 128 chat requests with 0%, 50%
and 100% of them JSON-schema constrained, side by side in one run (alternating rounds); the
host time of filling the grammar bitmasks for a batch of 64 rows; grammar compile time, cold
and cached.

    python3 bench/structured_overhead.py [--model SmolLM2-135M-Instruct] [--rounds 2]
        [--out bench/results/structured_overhead.md]

Throughput is output tokens / wall second of ``LLM.chat`` over the 128 requests (temperature
0.7, seeded), each generating exactly the tokens its JSON took under the constraint (64 at
most), constrained or not, after one untimed pass of each mix that compiles the step's
variants. Prints a markdown table; ``--out`` writes it
with the command, the machine's load and the date.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.step_timing import loadavg, log  # noqa: E402

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False,
               "required": ["name", "age", "city"],
               "properties": {"name": {"type": "string", "maxLength": 24},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "city": {"enum": ["London", "Paris", "Bath", "Highbury"]}}},
    "items": {"type": "object", "required": ["items"], "additionalProperties": False,
              "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                  "type": "object", "required": ["title", "tags"], "additionalProperties": False,
                  "properties": {"title": {"type": "string", "maxLength": 30},
                                 "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}}}},
    "choice-like": {"anyOf": [{"type": "null"}, {"enum": ["yes", "no"]},
                              {"type": "integer", "minimum": 0}]},
}


def _messages(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe person {i} of Emma by Jane Austen."}]
            for i in range(n)]


def throughput(llm, fraction: float, lengths: list[int]) -> tuple[float, int]:
    """(output tokens / s, tokens) of ``len(lengths)`` chat requests, ``fraction`` of them
    constrained; request ``i`` generates exactly ``lengths[i]`` tokens either way (its length
    under the constraint), so every mix does the same work but for the grammar's."""
    from jaxkv import SamplingParams
    from jaxkv.sample.structured import StructuredOutputsParams

    spec = StructuredOutputsParams(json=SCHEMAS["person"])
    n, k = len(lengths), round(len(lengths) * fraction)
    params = [SamplingParams(temperature=0.7, max_tokens=m, seed=i, **(
        dict(structured_outputs=spec) if i < k else dict(min_tokens=m, ignore_eos=True)))
        for i, m in enumerate(lengths)]
    start = time.perf_counter()
    outs = llm.chat(_messages(n), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, tokens


def constrained_lengths(llm, n: int) -> list[int]:
    """Each request's output length under the constraint (64 tokens at most)."""
    from jaxkv import SamplingParams
    from jaxkv.sample.structured import StructuredOutputsParams

    spec = StructuredOutputsParams(json=SCHEMAS["person"])
    outs = llm.chat(_messages(n), [SamplingParams(temperature=0.7, max_tokens=64, seed=i,
                                                  structured_outputs=spec) for i in range(n)],
                    use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in outs]


def bitmask_fill_ms(llm, rows: int = 64, repeats: int = 20) -> tuple[float, float]:
    """(ms to fill ``rows`` grammar bitmasks, ms to build the step's mask arrays from them):
    the host work a batch of ``rows`` constrained decode rows adds to a step."""
    from jaxkv import SamplingParams
    from jaxkv.sample import logit_controls
    from jaxkv.sample.structured import StructuredOutputsParams

    table = llm.engine._table
    spec = StructuredOutputsParams(json=SCHEMAS["person"])
    matchers = [table.grammars().matcher(spec) for _ in range(rows)]
    prefix = llm.tokenizer.encode('{"name": "Emma', add_special_tokens=False)
    for m in matchers:
        for t in prefix:
            m.accept(t)
    v, params = table.vocab_size, [SamplingParams()] * rows
    fills, builds = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        masks = [m.bitmasks(())[0] for m in matchers]
        t1 = time.perf_counter()
        logit_controls.host_arrays(params, [()] * rows, v, rows, masks)
        fills.append(t1 - t0)
        builds.append(time.perf_counter() - t1)
    return statistics.median(fills) * 1e3, statistics.median(builds) * 1e3


def compile_ms(llm) -> list[tuple[str, float, float]]:
    """Per schema: (name, cold ms in a fresh compiler, cached ms)."""
    from jaxkv.sample.structured import GrammarCompiler, StructuredOutputsParams

    compiler = GrammarCompiler(llm.tokenizer, llm.engine._table.vocab_size)
    out = []
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        compiler.compile(spec)
        t1 = time.perf_counter()
        compiler.compile(spec)
        out.append((name, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from jaxkv import LLM

    loads = [loadavg()[0]]
    with LLM(args.model, max_model_len=1024, max_num_seqs=64) as llm:
        fractions = (0.0, 0.5, 1.0)
        rates = {f: [] for f in fractions}
        lengths = constrained_lengths(llm, args.requests)
        for f in fractions:   # warm-up: compiles every step variant (with and without masks)
            throughput(llm, f, lengths)
        for r in range(args.rounds):
            for f in fractions if r % 2 == 0 else fractions[::-1]:
                rate, tokens = throughput(llm, f, lengths)
                rates[f].append(rate)
                loads.append(loadavg()[0])
                log(f"round {r}: {f:.0%} constrained: {rate:.1f} tok/s ({tokens} tokens)")
        fill, build = bitmask_fill_ms(llm)
        compiled = compile_ms(llm)
    base = statistics.median(rates[0.0])
    lines = ["| constrained | output tok/s (median of rounds) | vs 0% |", "|---|---|---|"]
    lines += [f"| {f:.0%} | {statistics.median(v):.1f} ({', '.join(f'{x:.1f}' for x in v)}) "
              f"| {statistics.median(v) / base:.2f} |" for f, v in rates.items()]
    lines += ["", f"Host time per step at 64 constrained rows: {fill:.2f} ms filling the "
              f"bitmasks, {build:.2f} ms building the step's arrays.", "",
              "| schema | compile, cold ms | cached ms |", "|---|---|---|"]
    lines += [f"| {n} | {cold:.1f} | {hot:.3f} |" for n, cold, hot in compiled]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(
            f"`python3 bench/structured_overhead.py --rounds {args.rounds}` on {args.model}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, 1-min load "
            f"{min(loads):.2f}-{max(loads):.2f}\n\n{text}\n")


if __name__ == "__main__":
    main()
