"""The decoder's matmuls alone on the CPU: weights stored [in, out] vs torch's [out, in].

SmolLM2-135M's 30 layers of projections (q 576x576, k/v 576x192, o 576x576, gate/up 576x1536,
down 1536x576) and the tied LM head (49,152 x 576), fp32, chained as in the model (each layer
feeds the next, so XLA cannot run two layers' dots at once), for ``--rows`` token rows, in one
jitted function per layout:

    in-out   x @ w         w [in, out]   (jaxkv's layout, jaxkv/model/llama.py)
    out-in   x . w^T       w [out, in]   (dot_general contracting both last dims; tried in the
                                          engine and not kept: BENCHMARKS.md, "What did not work")

Runs the layouts alternately, ``--repeats`` rounds of ``--iters`` calls each, and reports the
median and min-max of the per-round medians, the out-in / in-out ratio, and a memcpy of the
weights' bytes (the streaming floor) with the load average before and after.

    python3 bench/experiments/weight_layout.py --rows 1 --rows 8 --rows 32 --rows 128 --rows 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/, for lib/ and the suite
from lib.step_timing import loadavg  # noqa: E402

E, F, HKV_D, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
SHAPES = {"q": (E, E), "k": (E, HKV_D), "v": (E, HKV_D), "o": (E, E), "gate": (E, F),
          "up": (E, F), "down": (F, E)}          # (in, out)


def make_weights(seed: int = 0):
    """(in-out layers, out-in layers, embedding [V, E]): the same values in both layouts."""
    rng = np.random.default_rng(seed)
    layers = [{k: rng.standard_normal(s, dtype=np.float32) * 0.02 for k, s in SHAPES.items()}
              for _ in range(LAYERS)]
    in_out = [{k: jnp.asarray(w) for k, w in p.items()} for p in layers]
    out_in = [{k: jnp.asarray(np.ascontiguousarray(w.T)) for k, w in p.items()} for p in layers]
    emb = jnp.asarray(rng.standard_normal((VOCAB, E), dtype=np.float32) * 0.02)
    return in_out, out_in, emb


def chain(mm):
    """The 30 layers' dots as the decoder chains them, with matmul ``mm(x, w)``."""
    def f(layers, emb, x):                                       # x [T, E]
        for p in layers:
            q, k, v = mm(x, p["q"]), mm(x, p["k"]), mm(x, p["v"])
            a = q + jnp.tile(k + v, (1, E // HKV_D))             # stands in for attention
            x = x + mm(a, p["o"])
            x = x + mm(jax.nn.silu(mm(x, p["gate"])) * mm(x, p["up"]), p["down"])
        return jax.lax.dot_general(x, emb, (((1,), (1,)), ((), ())))   # [T, V]
    return jax.jit(f)


IN_OUT = chain(lambda x, w: x @ w)
OUT_IN = chain(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))


def time_calls(fn, args, iters: int) -> float:
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def memcpy_ms(nbytes: int) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, action="append", help="token rows T (repeatable)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = a.rows or [8, 32]
    in_out, out_in, emb = make_weights()
    nbytes = sum(w.nbytes for p in in_out for w in p.values()) + emb.nbytes
    out = {"command": "python3 bench/experiments/weight_layout.py " + " ".join(
        f"--rows {r}" for r in rows), "load_before": loadavg(), "weight_mb": nbytes / 1e6,
        "memcpy_ms": memcpy_ms(nbytes), "rows": {}}
    print(f"weights {nbytes / 1e6:.0f} MB, memcpy {out['memcpy_ms']:.1f} ms, "
          f"load {out['load_before']}")
    print("| rows | in-out ms | out-in ms | out-in / in-out |\n|---|---|---|---|")
    for t in rows:
        x = jnp.asarray(np.random.default_rng(1).standard_normal((t, E), dtype=np.float32))
        want = np.asarray(IN_OUT(in_out, emb, x))
        np.testing.assert_allclose(np.asarray(OUT_IN(out_in, emb, x)), want, rtol=1e-4, atol=1e-4)
        res = {"in-out": [], "out-in": []}
        for _ in range(a.repeats):
            res["in-out"].append(time_calls(IN_OUT, (in_out, emb, x), a.iters))
            res["out-in"].append(time_calls(OUT_IN, (out_in, emb, x), a.iters))
        med = {k: statistics.median(v) for k, v in res.items()}
        out["rows"][t] = {"runs_ms": res, "median_ms": med, "ratio": med["out-in"] / med["in-out"]}
        fmt = lambda v: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
        print(f"| {t} | {fmt(res['in-out'])} | {fmt(res['out-in'])} | "
              f"{out['rows'][t]['ratio']:.2f} |", flush=True)
    out["load_after"] = loadavg()
    print(f"load after {out['load_after']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
