"""Two engines in one process, differing in one trace-time setting, their decode steps alternated.

Between processes this machine's decode step moves by up to 25% (bench/decode_step.py's rounds),
more than most changes it is asked to show; inside one process, steps of A and B taken in turn
see the same load. Engine B is built and traced with the ``--set`` assignments in place (e.g.
``jaxkv.model.linear.SMALL_ROWS=32``), engine A without them; both then decode the same
``--batch`` requests (``--prompt`` tokens of Austen each, greedy), A and B one step each in turn,
``--steps`` times, and the wall time of every ``llm.step()`` is reported (median and quartiles,
milliseconds). ``--a-unfused`` builds A with each dense product in its own kernel call (the
model before ``linear.linears`` shared one call between q/k/v and between gate/up).

    PYTHONPATH=. python3 bench/experiments/step_ab.py --batch 32 \
        --set jaxkv.model.linear.SMALL_ROWS=32
    PYTHONPATH=. python3 bench/experiments/step_ab.py --batch 8 --a-unfused
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import statistics
import sys
from pathlib import Path

from jaxkv import LLM, SamplingParams
from jaxkv.model import linear, llama
from jaxkv.data import austen

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/, for lib/ and the suite
from lib.step_timing import decoding, loadavg, timed_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
AUSTEN_BOOK = "pride_and_prejudice"


def parse_setting(text: str) -> tuple[object, str, object]:
    """``module.attr=value`` (value a Python literal) -> (module, attr, value)."""
    target, value = text.split("=", 1)
    module, attr = target.rsplit(".", 1)
    return importlib.import_module(module), attr, ast.literal_eval(value)


@contextlib.contextmanager
def assigned(settings: list[tuple[object, str, object]]):
    """Module attributes set to the given values, restored on exit."""
    old = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in settings]
    try:
        for mod, attr, value in settings:
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in reversed(old):
            setattr(mod, attr, value)


def unfused_linears(x, ws):
    """``linear.linears`` with one call per weight."""
    return tuple(linear.linear(x, w) for w in ws)


def decoding_engine(prompts: list[list[int]], batch: int) -> LLM:
    """An engine with ``batch`` greedy requests, stepped until all decode (traced here)."""
    llm = LLM(str(GGUF), dtype="float32", seed=0, max_model_len=1024,
              max_num_batched_tokens=512, max_num_seqs=batch, num_kv_blocks=4097)
    for p in prompts:
        llm.add_request({"prompt_token_ids": p},
                        SamplingParams(temperature=0, max_tokens=1000 - len(p), ignore_eos=True))
    while not decoding(llm):
        llm.step()
    llm.step()                                   # the decode step's compilation
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="engine B's trace-time setting (repeatable)")
    ap.add_argument("--a-unfused", action="store_true",
                    help="engine A: one kernel call per dense product")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from jaxkv.model.gguf import open_gguf
    from jaxkv.model.tokenizer import Tokenizer
    ids = Tokenizer.from_gguf_metadata(open_gguf(GGUF)).encode(austen(AUSTEN_BOOK))
    prompts = [ids[i * 997:i * 997 + a.prompt] for i in range(a.batch)]
    with assigned([(llama, "linears", unfused_linears)] if a.a_unfused else []):
        engine_a = decoding_engine(prompts, a.batch)
    with assigned([parse_setting(x) for x in a.set]):
        engine_b = decoding_engine(prompts, a.batch)
    load_before = loadavg()
    ms = {"A": [], "B": []}
    for _ in range(a.steps):
        for name, llm in (("A", engine_a), ("B", engine_b)):
            ms[name].append(1e3 * timed_step(llm).wall_s)
    result = {"command": sys.argv, "batch": a.batch, "prompt": a.prompt,
              "A": "unfused linears" if a.a_unfused else "defaults", "B": a.set or "defaults",
              "load_before": load_before, "load_after": loadavg()}
    for name, v in ms.items():
        q = statistics.quantiles(v, n=4)
        result[name + "_ms"] = {"median": statistics.median(v), "q25": q[0], "q75": q[2]}
        print(f"{name}: median {statistics.median(v):.1f} ms (quartiles {q[0]:.1f}-{q[2]:.1f})")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
