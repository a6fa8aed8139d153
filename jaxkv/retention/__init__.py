"""KV retention: which KV blocks of a sequence the engine keeps (the seam of every policy).

A policy answers two questions the pure scheduler asks (jaxkv/sched/scheduler.py), and fixes how the
attention reads what is kept:

* ``drops(num_computed, table, scores, block_size, prompt_tokens)``: before the scheduler allocates for a
  request whose next query token sits at position ``num_computed``, the logical blocks to give
  back (for a window: those no query from there on can see, ``droppable``; for H2O: the
  lowest-scoring ones beyond the budget, from the attention mass the step returns, see
  ``Retention.observe``; for SnapKV: once, at the prompt's end, its lowest-scoring prompt
  blocks, hence ``prompt_tokens``). The scheduler gives them back (``BlockManager.release_blocks``:
  the table entry becomes the null block 0, as in vLLM's sliding-window manager; a block another
  table shares only loses a reference) so the pool holds only what attention can still read.
* ``max_blocks(num_tokens, max_step_tokens, block_size, prompt_tokens)``: the most blocks a request of
  ``num_tokens`` tokens ever holds at once, for admission (a request that could never fit is
  refused, as without retention).
* ``attention``: the ``AttentionOptions`` the model runs with (window, sinks, and the positions
  the sinks are scored at), so masks and dropped blocks agree by construction.

One module per policy: ``full.py`` (keep everything), ``streaming.py`` (StreamingLLM: attention
sinks + a rolling window), ``h2o.py`` (heavy hitters by accumulated attention mass + a recent
window, in a token budget), ``snapkv.py`` (the prompt compressed once at the end of prefill by
its observation window's pooled attention) and ``random_evict.py`` (H2O's budget, random
victims: the baseline). ``from_args`` builds the policy of a ``jaxkv.config.RetentionArgs``.
"""

from __future__ import annotations

from jaxkv.retention.full import FullRetention, Retention
from jaxkv.retention.h2o import H2ORetention
from jaxkv.retention.random_evict import RandomRetention
from jaxkv.retention.snapkv import SnapKVRetention
from jaxkv.retention.streaming import StreamingRetention

__all__ = ["FullRetention", "H2ORetention", "RandomRetention", "Retention",
           "SnapKVRetention", "StreamingRetention", "from_args"]


def from_args(args, model_sliding_window: int | None = None) -> Retention:
    """The retention policy of a ``jaxkv.config.RetentionArgs`` (``kv_retention`` and its fields).

    Args:
      args: the engine's retention arguments.
      model_sliding_window: the model's own sliding window (None for full attention).

    Raises:
      ValueError: naming the field, when ``streaming`` lacks ``kv_window_tokens``, the H2O,
        random or SnapKV budget cannot hold its sinks and recent (observation) window, or the
        model already has a sliding window of its own.
    """
    if args.kv_retention == "full":
        return FullRetention(sliding_window=model_sliding_window)
    if model_sliding_window is not None:
        raise ValueError(f"kv_retention={args.kv_retention!r}: the model already attends "
                         f"through its own sliding_window={model_sliding_window}; use "
                         f"kv_retention='full'")
    if args.kv_retention in ("h2o", "random"):
        policy = H2ORetention if args.kv_retention == "h2o" else RandomRetention
        return policy(budget_tokens=args.kv_budget_tokens,
                      sink_tokens=args.kv_sink_tokens)
    if args.kv_retention == "snapkv":
        window = args.kv_observation_tokens
        return SnapKVRetention(budget_tokens=args.kv_budget_tokens,
                               sink_tokens=args.kv_sink_tokens,
                               **({} if window is None else dict(window_tokens=window)))
    return StreamingRetention(sink_tokens=args.kv_sink_tokens,
                              window_tokens=args.kv_window_tokens,
                              positions=args.kv_positions)
