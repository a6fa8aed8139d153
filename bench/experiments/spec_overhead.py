"""What speculative decoding's machinery costs when it drafts nothing: per-step device and host
milliseconds of three engines on the same batch, round robin.

* ``none``: no speculation;
* ``ngram``: ``speculative="ngram"``, adaptive up to ``--k`` (on workloads where it does not
  pay, the step-time rule drafts nothing, but every step still proposes, allocates and records);
* ``empty``: the same engine with a proposer that never proposes (the speculator's bookkeeping
  without the lookups).

The batch is bench/speculative.py's ``--workload`` at ``--context`` tokens, on engines built by
its ``engine`` and decoded from the prefix cache (two untimed runs first: compile, then fill
the cache); each timed run reports
device ms per step (the jitted step's wall time, ``ModelRunner.device_time``) and host ms per
step (the rest of ``chat``'s wall time). Greedy; SmolLM2-135M-Instruct fp32.

    python3 bench/experiments/spec_overhead.py --batch 4 --rounds 4 \
        --json bench/experiments/results/spec_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from jaxkv import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/, for lib/ and the suite
from speculative import conversations, engine  # noqa: E402


class NoProposals:
    """A proposer that never proposes."""

    def propose(self, token_ids, num_drafts):
        return ()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="summary")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.set_defaults(kv_cache_dtype="auto", warmup=False)   # read by speculative.engine
    args = ap.parse_args()
    convs = conversations(args.workload, args.batch, args.context)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    adaptive = ("ngram", args.k, True)   # bench/speculative.py's engines, sized alike
    engines = {"none": engine(args.batch, (None, 0, False), args),
               "ngram": engine(args.batch, adaptive, args),
               "empty": engine(args.batch, adaptive, args)}
    engines["empty"].engine.speculator.proposer = NoProposals()
    for llm in engines.values():
        for _ in range(2):
            llm.chat(convs, params, use_tqdm=False)
    load = os.getloadavg()
    before = {name: llm.stats().get("spec_num_draft_tokens", 0) for name, llm in engines.items()}
    runs = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            runner = llm.engine.runner
            device, steps = runner.device_time, runner.num_steps
            t0 = time.perf_counter()
            llm.chat(convs, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            device, steps = runner.device_time - device, runner.num_steps - steps
            runs[name].append(dict(wall_s=wall, device_ms_per_step=1e3 * device / steps,
                                   host_ms_per_step=1e3 * (wall - device) / steps, steps=steps))
    drafted = {name: llm.stats().get("spec_num_draft_tokens", 0) - before[name]   # timed rounds
               for name, llm in engines.items()}
    for llm in engines.values():
        llm.close()
    result = dict(args=vars(args), load_average_start_end=[load, os.getloadavg()],
                  date=time.strftime("%Y-%m-%d %H:%M"), drafts_verified=drafted, runs=runs)
    for name, rs in runs.items():
        device = [r["device_ms_per_step"] for r in rs]
        host = statistics.median(r["host_ms_per_step"] for r in rs)
        print(f"{name:6s} device ms/step {statistics.median(device):6.1f} "
              f"({', '.join(f'{x:.1f}' for x in device)})   host ms/step {host:5.2f}   "
              f"drafts verified {drafted[name]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
