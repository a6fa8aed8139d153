"""The static options of a layer's attention (part of the compiled step): ``AttentionOptions``,
how it reads the kept KV (window, sinks, StreamingLLM's sink positions, H2O's attention mass),
which the retention policies choose; and ``QuestOptions``, Quest's page budget."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """How the model's attention reads the kept KV (static: part of the compiled step).

    Attributes:
      sliding_window: attend to the last ``sliding_window`` positions (itself included), or
        None for full causal attention.
      num_sinks: with a window, the first ``num_sinks`` positions stay visible.
      sink_position_cap: None, or StreamingLLM's positions within the cache: a query at position
        ``p`` scores the sinks as if it sat at ``min(p, sink_position_cap)`` (= sinks + window -
        1), the position it holds in the cache ``[sinks | window]``. Keys keep their original
        rotation: RoPE scores depend only on the distance of query and key, and a window key's
        distance to the query is the same in both numberings, so only the sinks' scores change
        (jaxkv/retention/streaming.py).
      observe: > 0: the step also returns the attention mass per KV block of each sequence's
        last ``observe`` query tokens, summed over layers and heads (jaxkv/attention/mass.py;
        H2O's scores).
      sm_scale, soft_cap: the model's own softmax scale (default ``1/sqrt(head_dim)``) and
        logit soft-cap (Gemma 2), which the decoder sets per layer.
    """

    sliding_window: int | None = None
    num_sinks: int = 0
    sink_position_cap: int | None = None
    observe: int = 0
    sm_scale: float | None = None
    soft_cap: float | None = None


@dataclasses.dataclass(frozen=True)
class QuestOptions:
    """Quest in the model's attention layer (static: part of the compiled step).

    Attributes:
      budget: pages each (decode sequence, kv head) attends to, forced pages included
        (>= ``min_budget``); a budget of ``max_blocks`` pages selects every live page.
      num_sinks: sink positions every decode token attends to.
      recent: most recent positions every decode token attends to (itself included, >= 1).
    """

    budget: int
    num_sinks: int = 0
    recent: int = 1
