"""The one jitted engine step: model forward over the paged cache, sampling, draft verification.

    (params, cache, step_input, sampling_tensors, rng)
        -> (cache, tokens, num_accepted, logprobs, top_logprobs)

The cache is donated, so its pools are updated in place. Every input is padded on the host to a
(T tokens, S sequences) bucket (jaxkv/runner/batch.py), so the step compiles once per bucket and
never again in steady state; ``num_logprobs`` and ``decode_only`` are its static arguments.
Each sequence has ``W`` logits rows (``W = 1``, or ``1 + num_speculative_tokens`` in a step that
verifies drafts: a second compiled width): row ``(s, j)`` is sampled like any row (the sampler
sees ``S x W`` rows, ``s * W + j``), and ``sample.rejection.num_accepted`` says how many of
sequence ``s``'s ``W`` tokens it emits.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache, partial

import jax
import jax.numpy as jnp

from jax.sharding import Mesh

from jaxkv.attention.dispatch import paged_attention
from jaxkv.attention.options import QuestOptions
from jaxkv.attention.options import AttentionOptions
from jaxkv.config.kv_groups import KVGroups
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pages import PagedKVCache
from jaxkv.model.config import ModelConfig
from jaxkv.model.llama import forward
from jaxkv.runner import sharding
from jaxkv.runner.batch import StepInput
from jaxkv.sample.rejection import num_accepted
from jaxkv.sample.sampler import SamplingTensors, sample

_DEVICE_FIELDS = ("token_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                  "block_tables", "logits_indices", "num_drafts", "sample_mask",
                  "group_slot_mapping", "group_block_tables")


@partial(jax.tree_util.register_dataclass, data_fields=list(_DEVICE_FIELDS), meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DeviceStepInput:
    """The device arrays of a ``batch.StepInput`` (int32; ``sample_mask`` bool)."""

    token_ids: jax.Array       # [T]
    positions: jax.Array       # [T]
    slot_mapping: jax.Array    # [T]
    query_start_loc: jax.Array  # [S + 1]
    seq_lens: jax.Array        # [S]
    block_tables: jax.Array    # [S, max_blocks_per_seq]
    logits_indices: jax.Array  # [S, W]
    num_drafts: jax.Array      # [S]
    sample_mask: jax.Array     # [S]
    group_slot_mapping: jax.Array   # [G - 1, T]
    group_block_tables: jax.Array   # [G - 1, S, max_blocks_per_seq]

    @classmethod
    def from_host(cls, step_input: StepInput) -> "DeviceStepInput":
        return cls(**{f: getattr(step_input, f) for f in _DEVICE_FIELDS})


def make_step(config: ModelConfig, *, attention_impl: str = "reference", interpret: bool = False,
              mesh: Mesh | None = None, attention_options: AttentionOptions | None = None,
              sparse: QuestOptions | None = None, kv_groups: KVGroups | None = None):
    """Builds the jitted step for one model.

    Args:
      config: the model's hyper-parameters.
      attention_impl: ``"reference"``, ``"grouped"`` or ``"pallas"`` (jaxkv.attention.dispatch).
      interpret: Pallas interpret mode (CPU runs of the kernels).
      mesh: tensor-parallel engine mesh (jaxkv.runner.sharding): params and cache arrive sharded by
        the logical axis rules, attention runs under ``shard_map`` per kv-head shard, the cache
        keeps its sharding and every other output is replicated. None: one device.
      attention_options: the KV retention policy's window, sinks and sink positions
        (jaxkv/retention/); default the model's own sliding window.
      sparse: Quest sparse decode attention (budget in pages, sinks, recent window; static):
        the step's decode sequences attend only to their selected pages. None: dense.
      kv_groups: the hybrid cache's layer groups (jaxkv/config/kv_groups.py; the inputs
        carry every group's slots and tables), or None: one group.

    Returns:
      ``step(params, cache, inputs: DeviceStepInput, sampling: SamplingTensors, rng, *,
      num_logprobs=0, decode_only=False) -> (cache, tokens int32 [S, W], num_accepted int32
      [S], logprobs f32 [S, W], (top_ids int32 [S, W, N], top_values f32 [S, W, N]),
      block_mass)``, jitted with the cache donated; ``sampling`` has ``S x W`` rows; sequence
      ``s`` emits ``tokens[s, :num_accepted[s]]`` with those rows' raw logprobs and top
      logprobs; ``block_mass`` is f32 [S, max_blocks] (the attention mass per KV block, when
      ``attention_options.observe``; jaxkv/attention/mass.py) or None. ``decode_only``: the
      caller's promise that every sequence has one token and no drafts
      (``AttentionMetadata.decode_only``; the Pallas path's split-K decode).
    """

    attention = paged_attention if mesh is None else sharding.sharded_attention(mesh)

    @partial(jax.jit, donate_argnums=1, static_argnames=("num_logprobs", "decode_only"))
    def step(params, cache: PagedKVCache, inputs: DeviceStepInput, sampling: SamplingTensors,
             rng: jax.Array, *, num_logprobs: int = 0, decode_only: bool = False):
        md = AttentionMetadata(slot_mapping=inputs.slot_mapping,
                               query_start_loc=inputs.query_start_loc,
                               seq_lens=inputs.seq_lens, block_tables=inputs.block_tables,
                               num_drafts=inputs.num_drafts,
                               group_slot_mapping=inputs.group_slot_mapping,
                               group_block_tables=inputs.group_block_tables,
                               decode_only=decode_only)
        s, w = inputs.logits_indices.shape
        logits, cache, *mass = forward(params, inputs.token_ids, inputs.positions, cache, md,
                                config=config, logits_indices=inputs.logits_indices.reshape(-1),
                                attention_impl=attention_impl, interpret=interpret,
                                attention=attention,
                                attention_options=attention_options, sparse=sparse,
                                row_queries=w, kv_groups=kv_groups)      # [S * W, V]
        if mesh is not None:
            logits = jax.lax.with_sharding_constraint(logits, sharding.replicated(mesh))
            cache = jax.lax.with_sharding_constraint(cache, sharding.cache_shardings(cache, mesh))
        tokens, logprobs, top = sample(logits, sampling, rng, num_logprobs=num_logprobs)
        tokens, logprobs, top = jax.tree.map(lambda x: x.reshape(s, w, *x.shape[1:]),
                                             (tokens, logprobs, top))
        drafts = inputs.token_ids[inputs.logits_indices[:, 1:]]              # [S, W - 1]
        accepted = num_accepted(tokens, drafts, inputs.num_drafts)
        if mesh is not None:
            tokens, accepted, logprobs, top = jax.lax.with_sharding_constraint(
                (tokens, accepted, logprobs, top), sharding.replicated(mesh))
        # a retention policy's scores (Retention.observe): the sampling queries' mass only
        block_mass = mass[0] * inputs.sample_mask[:, None] if mass else None
        return cache, tokens, accepted, logprobs, top, block_mass

    return step


def step_rng(seed: int, step_index: int) -> jax.Array:
    """The engine rng of one step: ``fold_in(PRNGKey(seed), step_index)`` as raw uint32 [2].

    One jitted call on the seed's cached key: the eager ops took ~0.85 ms of host time per
    step on the 2-core CPU box (a third of a batch-8 decode step's host work), this ~0.03 ms."""
    return _fold_in(_base_key(seed), step_index)


@lru_cache(maxsize=8)
def _base_key(seed: int) -> jax.Array:
    return jax.random.PRNGKey(seed)


@jax.jit
def _fold_in(key: jax.Array, step_index) -> jax.Array:
    return jax.random.fold_in(key, step_index).astype(jnp.uint32)
