"""KV retention: which KV blocks of a sequence the engine keeps (the seam of every policy).

Design notes: docs/retention.md."""

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
