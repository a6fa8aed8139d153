"""Teacher-forced perplexity of SmolLM2-135M under KV budgets: full cache, StreamingLLM (sinks +
window), H2O (heavy hitters + recent window), SnapKV (the prompt compressed once by its
observation window) and random eviction, through ``jaxkv.entrypoints.eval.retained_nll``.

    python bench/retention_ppl.py --out bench/results/retention_ppl.json
    python bench/retention_ppl.py --context 1536 --budgets 0.04 0.1 0.2 0.5 \
        --out bench/results/retention_ppl_context.json        # with SnapKV and random

``--texts`` disjoint segments of ``--tokens`` tokens from *Emma* (after ``--skip`` tokens), fed in
``--chunk``-token steps, through a pool of ``--block-size``-token blocks (the granularity at which
every policy drops: 1 evicts single tokens, as the papers do). Without ``--context`` there is no
prompt: policies drop from the first chunk on, every token is scored, and a budget of b% keeps
``b% x tokens`` KV tokens per sequence
(whole blocks; at least ``--min-blocks``). With ``--context P`` the first P tokens of each text
are a prompt computed in one forward with nothing dropped (the engine's prefill), the budget is
``b% x P``, and only the ``tokens - P`` continuation tokens are scored: H2O and random then keep
evicting to their budget, SnapKV compresses the prompt to it once and keeps every continuation
token (the paper's protocol; the peak blocks column says what each held). H2O observes the last
query of every chunk (``--chunk 1``: every query, the paper's accumulation) and keeps half its
budget as the recent window; ``h2o-all`` is H2O observing every query of every forward, the
prompt's included (the paper's scores: column sums of the prompt's attention, then each
generated query's), as random eviction does; streaming keeps 4 sinks + the rest as its
window; SnapKV keeps 4 sinks + its 32-token observation window (the prompt's last 32 tokens, whose
attention ranks the blocks, max-pooled over neighbouring blocks). Perplexity over the scored
tokens, relative to the full cache on the same texts.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxkv import LLM
from jaxkv.data import austen
from jaxkv.entrypoints.eval import retained_nll
from jaxkv.retention import (FullRetention, H2ORetention, RandomRetention, SnapKVRetention,
                             StreamingRetention)



def h2o_every_query(longest_forward: int) -> type:
    """H2O scored by every query of each forward (``observe`` = the longest forward, the prompt
    or a chunk), where the engine's H2O observes each step's sampling query only."""
    return type("H2OEveryQuery", (H2ORetention,), {"observe": longest_forward})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/retention_ppl.json")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--texts", type=int, default=2)
    ap.add_argument("--skip", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    ap.add_argument("--context", type=int, default=0,
                    help="prompt tokens per text (0: no prompt phase, no SnapKV)")
    ap.add_argument("--min-blocks", type=int, default=3,
                    help="smallest budget in blocks (5 with SnapKV: its sinks and window span 4 "
                         "at block size 16)")
    ap.add_argument("--policies", nargs="+", default=["h2o", "streaming", "snapkv", "random"])
    ap.add_argument("--block-size", type=int, default=16,
                    help="tokens per KV block: the granularity at which policies drop")
    args = ap.parse_args()

    with LLM(max_model_len=args.tokens + 16, max_num_seqs=1, block_size=args.block_size) as llm:
        runner = llm.engine.runner
        bs = runner.cache_config.block_size
        ids = llm.tokenizer.encode(austen("emma"))
        texts = [np.asarray(ids[args.skip + i * args.tokens:args.skip + (i + 1) * args.tokens
                                + 1], np.int32) for i in range(args.texts)]
        make = dict(h2o=lambda n: H2ORetention(budget_tokens=n, sink_tokens=4),
                    **{"h2o-all": lambda n: h2o_every_query(max(args.context, args.chunk))(
                        budget_tokens=n, sink_tokens=4)},
                    random=lambda n: RandomRetention(budget_tokens=n, sink_tokens=4),
                    snapkv=lambda n: SnapKVRetention(budget_tokens=n, sink_tokens=4),
                    streaming=lambda n: StreamingRetention(sink_tokens=4, window_tokens=n - 4))
        policies = [p for p in args.policies if args.context or p != "snapkv"]
        floor = max(args.min_blocks, 5) if "snapkv" in policies else args.min_blocks
        configs = [("full", None, None, FullRetention())]
        for b in args.budgets:
            budget = max(bs * floor, int(b * (args.context or args.tokens)) // bs * bs)
            configs += [(p, b, budget, make[p](budget)) for p in policies]
        for *_, policy in configs:
            policy.check_block_size(bs, 0)
        rows = []
        for name, frac, budget, policy in tqdm(configs, desc="budgets"):
            runs = [retained_nll(runner, t, retention=policy, kv_cache_dtype="fp32",
                                 chunk=args.chunk, prompt_tokens=args.context) for t in texts]
            nll = np.concatenate([r.nll[args.context:] for r in runs])
            rows.append({"policy": name, "budget": frac, "budget_tokens": budget,
                         "ppl": float(np.exp(nll.mean())), "tokens": len(nll),
                         "peak_blocks": max(r.peak_blocks for r in runs),
                         "seconds": sum(r.seconds for r in runs),
                         "loadavg": [round(x, 2) for x in os.getloadavg()]})
            print(rows[-1], flush=True)
    full = rows[0]["ppl"]
    for r in rows:
        r["vs_full"] = r["ppl"] / full
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
