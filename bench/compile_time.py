"""Compile count x time of the engine's step variants, and ``LLM.warmup()`` end to end (issue 16).

Builds ``jaxkv.LLM`` on SmolLM2-135M (GGUF, fp32) with bench/peers.py's scheduling limits
(``max_num_batched_tokens`` 512, ``max_num_seqs`` 256: 27 (tokens, sequences) buckets) on an
empty persistent compilation cache, then for each bucket in turn times

* trace: ``jit(step).lower(...)`` (Python: tracing the model and lowering it to StableHLO);
* compile: ``.compile()`` of that (XLA);
* first run: the jitted step called on padding, which finds the executable in JAX's caches.

With ``--warmup`` a second process on its own empty cache times ``LLM.warmup()`` (traced here,
compiled on two threads, see ``ModelRunner.warmup``) instead. Prints one JSON object (each
variant's row also goes to stderr as it is measured).

    python3 bench/compile_time.py
    python3 bench/compile_time.py --warmup
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "models" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
LIMITS = dict(max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", action="store_true", help="time LLM.warmup() instead")
    args = ap.parse_args()
    os.environ["JAXKV_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxkv-compile-")
    load0 = os.getloadavg()
    from jaxkv import LLM   # after the cache directory is set

    t0 = time.perf_counter()
    llm = LLM(str(GGUF), dtype="float32", seed=0, num_kv_blocks=4097, **LIMITS)
    out = {"load_s": time.perf_counter() - t0, "limits": LIMITS}
    if args.warmup:
        t0 = time.perf_counter()
        out["variants"] = llm.warmup()
        out["warmup_s"] = time.perf_counter() - t0
    else:
        runner = llm.engine.runner
        s, rows = runner.sched_config, []
        buckets, decode = s.step_shapes()
        for t, n in buckets + decode:
            step_args = runner._padded_args(t, n, 1)
            t0 = time.perf_counter()
            lowered = runner._step_fn.lower(runner.params, runner.cache, *step_args,
                                            num_logprobs=0)
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            runner.cache, tokens, *_ = runner._step_fn(runner.params, runner.cache,
                                                       *step_args, num_logprobs=0)
            tokens.block_until_ready()
            rows.append({"tokens": t, "seqs": n, "trace_s": t1 - t0, "compile_s": t2 - t1,
                         "first_run_s": time.perf_counter() - t2})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)   # progress
        out["variants"] = rows
        out["totals_s"] = {k: sum(r[k] for r in rows)
                           for k in ("trace_s", "compile_s", "first_run_s")}
    out["loadavg"] = [load0, os.getloadavg()]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
