"""T's whole pass on two engines in one process, their steps interleaved: an A/B that the
machine's drift does not decide.

Between runs of bench/step_mix.py a pass of T moves by 5-10% with the hour (its prefill steps
took 748-851 ms a step in one afternoon, same code), more than most changes it is asked to
show. Here engines A and B (SmolLM2-135M fp32, bench/step_mix.py's limits, B with the
``--b-engine-arg`` settings, A with ``--a-engine-arg``) both queue T's 128 requests, and then
take one step each in turn (A first in even rounds, B first in odd ones) until both are done,
so each pair of steps sees the same load. Both schedulers see the same requests, so step i of
A and of B have the same plan wherever their settings do not change the scheduling (checked:
the steps' token and sequence counts are compared). Reported: each engine's device seconds
(``runner.execute``) in total and by step group (bench/step_mix.py's), their ratio, the
per-step ratio's median and quartiles, and whether their greedy tokens agree.

    python3 bench/experiments/pass_ab.py --b-engine-arg "decode_buckets=()"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/, for lib/ and the suite
from decode_step import engine_arg  # noqa: E402
from lib.step_timing import loadavg  # noqa: E402
from step_mix import add_workload, engine, step_groups, time_steps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for side in "ab":
        ap.add_argument(f"--{side}-engine-arg", action="append", default=[],
                        metavar="KEY=VALUE", help=f"an LLM keyword argument of engine "
                        f"{side.upper()} (VALUE a Python literal where it is one; repeatable)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    kwargs = {side: dict(engine_arg(kv) for kv in getattr(a, f"{side}_engine_arg"))
              for side in "ab"}
    llms = {side: engine(**kwargs[side]) for side in "ab"}
    for llm in llms.values():
        llm.warmup()
    logs = {side: time_steps(llm) for side, llm in llms.items()}
    for llm in llms.values():
        add_workload(llm)
    outs = {side: {} for side in "ab"}
    load = loadavg()
    t0, rounds = time.perf_counter(), 0
    while any(llm.has_unfinished_requests() for llm in llms.values()):
        for side in ("ab" if rounds % 2 == 0 else "ba"):
            if llms[side].has_unfinished_requests():
                for o in llms[side].step():
                    outs[side][o.request_id] = o.outputs[0].token_ids
        rounds += 1
    wall = time.perf_counter() - t0
    x = {side: np.array(log) for side, log in logs.items()}
    same_plans = x["a"].shape == x["b"].shape and (x["a"][:, :2] == x["b"][:, :2]).all()
    sec = {side: x[side][:, 3] for side in "ab"}
    ids = sorted(outs["a"])
    agree = sum(list(outs["a"][i]) == list(outs["b"].get(i, ())) for i in ids)
    out = {"engine_args": kwargs, "wall_s": wall, "load_before": load, "load_after": loadavg(),
           "steps": {side: len(x[side]) for side in "ab"}, "same_plans": bool(same_plans),
           "requests_equal": f"{agree}/{len(ids)}", "groups": {}}
    print(f"A {kwargs['a']} vs B {kwargs['b']}: {out['steps']['a']} / {out['steps']['b']} "
          f"steps, same plans: {same_plans}, greedy tokens equal on {agree}/{len(ids)} "
          f"requests; load {load} -> {out['load_after']}")
    print("| steps | n | A s | B s | A / B |\n|---|---|---|---|---|")
    groups = [("all", np.ones(len(x["a"]), bool))] + (step_groups(logs["a"]) if same_plans
                                                     else [])
    for name, m in groups:
        if not m.any():
            continue
        g = {"n": int(m.sum()), "a_s": float(sec["a"][m].sum()), "b_s": float(sec["b"][m].sum())}
        g["ratio"] = g["a_s"] / g["b_s"]
        out["groups"][name] = g
        print(f"| {name} | {g['n']} | {g['a_s']:.1f} | {g['b_s']:.1f} | {g['ratio']:.3f} |")
    if same_plans:
        r = sec["a"] / sec["b"]
        out["per_step_ratio"] = dict(zip(("q25", "median", "q75"), np.percentile(r, [25, 50, 75])))
        print("per-step A / B: median {median:.3f} (quartiles {q25:.3f}-{q75:.3f})".format(
            **out["per_step_ratio"]))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
