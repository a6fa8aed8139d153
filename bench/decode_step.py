"""The engine's own jitted decode step on CPU, timed alone on the arguments of a real step.

Drives ``jaxkv.LLM`` on SmolLM2-135M (GGUF, fp32 by default) until ``--batch`` requests of
``--prompt`` Austen tokens are all decoding, records the arguments of one real decode step (a
wrapper around ``runner._blind_step_fn``, the step without the block mass that every decode
step without a retention policy runs), then calls the same jitted step ``--iters`` times on
them (the cache donated and threaded through, as the engine does) and reports the median and
spread.
Also reports the wall and device time of ``llm.step()``: the host milliseconds on the critical
path of a step (wall minus device: the jitted step is synchronous, so nothing of the host's
work overlaps it), split by phase (``scheduler.schedule``, ``batch.build``, the sampling
tensors, the transfers, the bookkeeping of the emitted tokens, ``scheduler.update``, the rest),
a weight-streaming floor (memcpy of the fp32 weights' bytes) and, with ``--hlo DIR``, writes the
optimized HLO of the step with a count of its copies, scatters, transposes and dots.

    python3 bench/decode_step.py --batch 8 --batch 64 [--dtype bfloat16] [--hlo /tmp/hlo]
    python3 bench/decode_step.py --batch 8 --batch 64 --batch 256 --prompt 64 --iters 5
    python3 bench/decode_step.py --batch 1 --batch 2 --prompt 4000 --max-model-len 8192

XLA flags: pass them as usual (``XLA_FLAGS=... python3 bench/decode_step.py``); one process
per setting, so the numbers of several settings come from several runs.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxkv import LLM, SamplingParams
from jaxkv.data import austen
from jaxkv.runner import batch
from jaxkv.sched import scheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/, for lib/ and the suite
from lib.step_timing import loadavg, timed_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
AUSTEN_BOOK = "pride_and_prejudice"


def hlo_counts(text: str) -> dict[str, int]:
    """Instruction opcodes of interest in an optimized HLO module (fusions counted by kind)."""
    ops = collections.Counter()
    for m in re.finditer(r"=\s*\S+\s+(\w[\w-]*)\(", text):
        ops[m.group(1)] += 1
    keep = ("copy", "scatter", "dynamic-update-slice", "transpose", "dot", "fusion", "gather",
            "custom-call", "while", "convert", "bitcast", "copy-start")
    return {k: ops[k] for k in keep if ops[k]}


def top_ops(trace_dir: Path, steps: int, hlo: str, n: int = 30) -> dict[str, float]:
    """Milliseconds per step of the ``n`` costliest groups of XLA ops in a jax.profiler trace.

    Each executed op (an event named after its HLO instruction, e.g. ``ynn_fusion.246``) is
    grouped by the jax op that produced it (the instruction's ``op_name`` metadata in the
    optimized HLO text ``hlo``, loop bodies and layers folded together) and its kind."""
    from jax._src.lib import _profile_data
    op_name = {}
    for m in re.finditer(r"%(\S+) = .*?\b(\w[\w-]*)\(.*?op_name=\"([^\"]*)\"", hlo):
        name = re.sub(r"\[.*?\]|\d+", "#", m.group(3))[-70:]
        op_name[m.group(1)] = f"{m.group(1).split('.')[0]} {name}"
    total = collections.Counter()
    for path in trace_dir.rglob("*.xplane.pb"):
        for plane in _profile_data.ProfileData.from_file(str(path)).planes:
            for line in plane.lines:
                for ev in line.events:
                    if ev.name in op_name or re.fullmatch(r"[\w-]+\.\d+", ev.name):
                        total[op_name.get(ev.name, ev.name.split(".")[0])] += ev.duration_ns
    return {k: round(v / 1e6 / steps, 3) for k, v in total.most_common(n)}


class PhaseTimer:
    """Seconds spent in named host functions of the engine step, by wrapping them in place."""

    def __init__(self):
        self.seconds = collections.Counter()

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
        setattr(owner, attr, timed)


def host_phases(llm: LLM) -> PhaseTimer:
    """A ``PhaseTimer`` on the host phases of ``llm``'s engine step (the module-level
    ``scheduler.schedule`` / ``update`` and ``batch.build`` are wrapped for the process)."""
    timer, core = PhaseTimer(), llm.engine
    timer.wrap(scheduler, "schedule", "schedule")
    timer.wrap(scheduler, "update", "update")
    timer.wrap(batch, "build", "batch_build")
    timer.wrap(core.runner, "sampling_tensors", "sampling_tensors")
    timer.wrap(core.runner, "transfer", "transfer")
    timer.wrap(core.speculator, "drafts", "drafts")
    timer.wrap(core, "_apply", "emit_tokens")
    timer.wrap(core, "_collect", "collect")
    return timer


def engine_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (KEY, VALUE as a Python literal, or the string where it is none)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--engine-arg {text!r}: expected KEY=VALUE")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, action="append", help="running sequences (repeatable)")
    ap.add_argument("--prompt", type=int, default=500, help="prompt tokens per request")
    ap.add_argument("--max-model-len", type=int, default=1024,
                    help="the engine's max_model_len (block tables max_model_len / 16 wide)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--token-buckets", help="comma list (default: the engine's)")
    ap.add_argument("--hlo", type=Path, help="write the optimized HLO of each step here")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="another LLM keyword argument, e.g. kv_cache_dtype=int8 or "
                    "kv_retention=streaming (VALUE read as a Python literal where it is one; "
                    "repeatable)")
    ap.add_argument("--profile", type=Path, help="trace 5 steps with jax.profiler into this "
                    "directory and print the XLA ops taking the most time")
    args = ap.parse_args()
    extra = dict(engine_arg(kv) for kv in args.engine_arg)
    batches = args.batch or [8]
    out: dict = {"load_start": loadavg(), "dtype": args.dtype, "jax": jax.__version__,
                 "xla_flags": __import__("os").environ.get("XLA_FLAGS", ""), "engine_args": extra}

    def max_tokens(B: int) -> int:
        """Tokens per request: the first requests decode while the last still prefill (512
        tokens a step, the running decodes' included), and must not finish before all B run."""
        return args.iters + 40 - (-B * args.prompt // max(1, 512 - B))

    t0 = time.perf_counter()
    llm = LLM(str(GGUF), dtype=args.dtype, seed=0, max_model_len=args.max_model_len,
              max_num_batched_tokens=512, max_num_seqs=max(batches),
              num_kv_blocks=1 + max(max(batches) * -(-(args.prompt + max_tokens(max(batches))
                                                       + 20) // 16),
                                    -(-args.max_model_len // 16)),
              **({"token_buckets": tuple(int(x) for x in args.token_buckets.split(","))}
                 if args.token_buckets else {}), **extra)
    out["start_s"] = time.perf_counter() - t0
    runner = llm.engine.runner
    ids = llm.tokenizer.encode(austen(AUSTEN_BOOK))
    orig = runner._blind_step_fn
    captured = {}

    def spy(params, cache, inputs, sampling, rng, **kw):
        captured["args"] = (inputs, sampling, rng, kw)
        return orig(params, cache, inputs, sampling, rng, **kw)

    spy._cache_size = orig._cache_size          # the runner counts compiles around each step

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.params))
    timer = host_phases(llm)
    for B in batches:
        for i in range(B):
            start = 1000 * i % (len(ids) - args.prompt)
            llm.add_request({"prompt_token_ids": ids[start: start + args.prompt]},
                            SamplingParams(temperature=0, max_tokens=max_tokens(B),
                                           ignore_eos=True))
        while llm.stats()["num_running"] < B or llm.stats()["num_waiting"]:
            if not llm.has_unfinished_requests():
                raise SystemExit(f"batch {B}: every request finished before {B} ran at once")
            llm.step()
        llm.step(); llm.step()                             # the decode bucket compiled
        walls, devs, phases = [], [], []
        for _ in range(10):
            p0 = timer.seconds.copy()
            st = timed_step(llm)
            walls.append(st.wall_s); devs.append(st.device_s)
            phases.append(timer.seconds - p0)
        host = [w - d for w, d in zip(walls, devs)]
        named = {k: 1e3 * statistics.median(p[k] for p in phases) for k in timer.seconds}
        named["other"] = 1e3 * statistics.median(h - sum(p.values())
                                                 for h, p in zip(host, phases))
        runner._blind_step_fn = spy
        llm.step()
        runner._blind_step_fn = orig
        inputs, sampling, rng, kw = captured["args"]
        res = {"T": int(inputs.token_ids.shape[0]), "S": int(inputs.seq_lens.shape[0]),
               "engine_step_ms": 1e3 * statistics.median(walls),
               "engine_device_ms": 1e3 * statistics.median(devs),
               "host_ms": 1e3 * statistics.median(host),
               "host_ms_range": [1e3 * min(host), 1e3 * max(host)],
               "host_share": statistics.median(h / w for h, w in zip(host, walls)),
               "host_phases_ms": named}
        text = orig.lower(runner.params, runner.cache, inputs, sampling, rng,
                          **kw).compile().as_text()
        res["hlo"] = hlo_counts(text)
        if args.hlo:
            args.hlo.mkdir(parents=True, exist_ok=True)
            (args.hlo / f"decode_b{B}.txt").write_text(text)
        ts, cpu = [], []
        for _ in range(args.iters + 1):
            t, c = time.perf_counter(), time.process_time()
            runner.cache, tokens, *_ = orig(runner.params, runner.cache, inputs, sampling, rng,
                                            **kw)
            tokens.block_until_ready()
            ts.append(time.perf_counter() - t); cpu.append(time.process_time() - c)
        ts, cpu = ts[1:], cpu[1:]
        if args.profile:
            with jax.profiler.trace(str(args.profile / f"b{B}")):
                for _ in range(5):
                    runner.cache, tokens, *_ = orig(runner.params, runner.cache, inputs,
                                                    sampling, rng, **kw)
                    tokens.block_until_ready()
            res["profile_top_ms_per_step"] = top_ops(args.profile / f"b{B}", steps=5, hlo=text)
        res.update(step_ms=1e3 * statistics.median(ts), step_min_ms=1e3 * min(ts),
                   step_cpu_ms=1e3 * statistics.median(cpu),
                   step_max_ms=1e3 * max(ts), load=loadavg())
        while llm.has_unfinished_requests():
            llm.step()
        out[f"batch_{B}"] = res
        print(json.dumps({f"batch_{B}": res}), flush=True)
    a = np.ones(weight_bytes // 4, np.float32)
    b = np.empty_like(a)
    ts = []
    for _ in range(5):
        t = time.perf_counter(); np.copyto(b, a); ts.append(time.perf_counter() - t)
    out.update(weight_bytes=weight_bytes, weight_copy_ms=1e3 * min(ts),
               copy_GBps=2 * a.nbytes / min(ts) / 1e9, load_end=loadavg())
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
