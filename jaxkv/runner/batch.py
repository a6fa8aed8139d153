"""StepPlan -> StepInput: the padded int32 arrays the device step reads (numpy, no jax).

Design notes: docs/scheduling.md."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jaxkv.blocks.block_manager import NULL_BLOCK, cdiv
from jaxkv.config import CacheConfig, SchedulerConfig
from jaxkv.sched.plan import StepPlan


@dataclasses.dataclass(frozen=True)
class StepInput:
    """Device inputs of one step, padded to a (T, S) bucket.

    Attributes:
      token_ids: token to compute at each position of the token axis, padding 0.
      positions: position of each token in its sequence, padding 0.
      slot_mapping: ``block_id * block_size + offset`` where each token's K/V is written;
        padding 0 (a slot of the null block).
      query_start_loc: cumulative query lengths; padding sequences repeat the last value.
      seq_lens: kv length of each sequence including this step's tokens, padding 0.
      block_tables: physical block of each logical block, padding 0 (the null block).
      logits_indices: row ``(s, j)`` indexes the token axis at sequence ``s``'s last known token
        (``j = 0``) or its ``j``-th draft token (``1 <= j <= num_drafts[s]``); 0 elsewhere and
        for sequences that do not sample.
      sample_mask: which sequences sample (rows ``(s, 0 .. num_drafts[s])`` are real).
      num_drafts: draft tokens of each sequence (the last ones of its query tokens), padding 0.
      num_tokens: unpadded token count (host metadata; the arrays alone define the step).
      num_seqs: unpadded sequence count (host metadata).
      group_slot_mapping, group_block_tables: a hybrid cache's ``slot_mapping`` and
        ``block_tables`` of groups 1, 2, ... (the fields above are group 0's); no rows with
        one group.
    """

    token_ids: np.ndarray        # int32 [T]
    positions: np.ndarray        # int32 [T]
    slot_mapping: np.ndarray     # int32 [T]
    query_start_loc: np.ndarray  # int32 [S + 1]
    seq_lens: np.ndarray         # int32 [S]
    block_tables: np.ndarray     # int32 [S, max_blocks_per_seq]
    logits_indices: np.ndarray   # int32 [S, W]
    sample_mask: np.ndarray      # bool  [S]
    num_drafts: np.ndarray       # int32 [S]
    num_tokens: int
    num_seqs: int
    group_slot_mapping: np.ndarray    # int32 [G - 1, T]
    group_block_tables: np.ndarray    # int32 [G - 1, S, max_blocks_per_seq]


def max_blocks_per_seq(cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> int:
    """Columns of ``block_tables``: blocks of a sequence of ``max_model_len`` tokens."""
    return cdiv(scheduler_config.max_model_len, cache_config.block_size)


def _fits(buckets: tuple[int, ...], n: int, name: str, count_name: str) -> None:
    if n > buckets[-1]:
        raise ValueError(f"plan has {count_name}={n}, more than {name}[-1]={buckets[-1]}")


def build(plan: StepPlan, cache_config: CacheConfig, scheduler_config: SchedulerConfig, *,
          max_drafts: int = 0) -> StepInput:
    """Flatten ``plan`` into padded device arrays (layout in the module docstring).

    Args:
      max_drafts: the most draft tokens a sequence may carry (the engine's
        ``num_speculative_tokens``, 0 without speculation); ``logits_indices`` is
        ``[S, 1 + max_drafts]`` when the plan has drafts, else ``[S, 1]``.

    Raises:
      ValueError: the plan exceeds the largest bucket, or a sequence's block table does not
        cover its tokens, exceeds ``max_blocks_per_seq``, names a block outside
        ``[0, num_blocks)`` or has the null block (an entry a retention policy dropped) where
        its tokens are written, or it carries more than ``max_drafts`` drafts (or drafts without
        sampling).
    """
    bs = cache_config.block_size
    m = max_blocks_per_seq(cache_config, scheduler_config)
    seqs = plan.seqs
    num_seqs = len(seqs)
    q_lens = np.array([len(s.token_ids) for s in seqs], np.int32)  # [num_seqs]
    starts = np.array([s.start_pos for s in seqs], np.int32)        # [num_seqs]
    num_tokens = int(q_lens.sum())
    _fits(scheduler_config.token_buckets, num_tokens, "token_buckets", "num_tokens")
    _fits(scheduler_config.seq_buckets, num_seqs, "seq_buckets", "num_seqs")
    t_pad, s_pad = scheduler_config.padded_shape(num_tokens, num_seqs)

    groups = cache_config.kv_groups.num_groups
    tables = np.zeros((groups, s_pad, m), np.int32)  # [G, S, M]
    for i, seq in enumerate(seqs):
        if len(seq.group_tables) != groups - 1:
            raise ValueError(f"seq {seq.request_id!r}: {1 + len(seq.group_tables)} block "
                             f"tables for {groups} cache groups")
        for g, table in enumerate((seq.block_table, *seq.group_tables)):
            _check_table(seq, table, cache_config, m)
            tables[g, i, :len(table)] = table
        if seq.num_drafts and not (seq.sample and seq.num_drafts < len(seq.token_ids)
                                   and seq.num_drafts <= max_drafts):
            raise ValueError(f"seq {seq.request_id!r}: num_drafts={seq.num_drafts} needs a "
                             f"sampling seq with more tokens and at most "
                             f"max_drafts={max_drafts}")
    block_tables = tables[0]

    query_start_loc = np.full(s_pad + 1, num_tokens, np.int32)  # [S + 1]
    query_start_loc[0] = 0
    query_start_loc[1:num_seqs + 1] = np.cumsum(q_lens)
    seq_lens = np.zeros(s_pad, np.int32)  # [S]
    seq_lens[:num_seqs] = starts + q_lens

    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)  # [num_tokens]
    pos = (starts[seq_of_token]
           + np.arange(num_tokens) - query_start_loc[seq_of_token]).astype(np.int32)  # [num_tokens]
    token_ids = np.zeros(t_pad, np.int32)  # [T]
    token_ids[:num_tokens] = np.fromiter(
        itertools.chain.from_iterable(s.token_ids for s in seqs), np.int32, count=num_tokens)
    positions = np.zeros(t_pad, np.int32)  # [T]
    positions[:num_tokens] = pos
    slots = np.zeros((groups, t_pad), np.int32)  # [G, T]
    slots[:, :num_tokens] = tables[:, seq_of_token, pos // bs] * bs + pos % bs
    slot_mapping = slots[0]

    sample_mask = np.zeros(s_pad, bool)  # [S]
    sample_mask[:num_seqs] = [s.sample for s in seqs]
    num_drafts = np.zeros(s_pad, np.int32)  # [S]
    num_drafts[:num_seqs] = [s.num_drafts for s in seqs]
    width = 1 + max_drafts if num_drafts.any() else 1
    last = query_start_loc[1:] - 1 - num_drafts                           # [S] last known token
    j = np.arange(width, dtype=np.int32)                                  # [W]
    real = sample_mask[:, None] & (j[None, :] <= num_drafts[:, None])     # [S, W]
    logits_indices = np.where(real, last[:, None] + j[None, :], 0).astype(np.int32)  # [S, W]
    return StepInput(token_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                     logits_indices, sample_mask, num_drafts, num_tokens, num_seqs,
                     slots[1:], tables[1:])


def _check_table(seq, table: tuple[int, ...], cache_config: CacheConfig, m: int) -> None:
    """Raises ValueError unless ``table`` covers ``seq``'s tokens with valid ids, none the
    null block where they are written."""
    bs = cache_config.block_size
    if not seq.token_ids or seq.start_pos < 0:
        raise ValueError(f"seq {seq.request_id!r}: token_ids must be non-empty and "
                         f"start_pos={seq.start_pos} >= 0")
    end = seq.start_pos + len(seq.token_ids)
    if not cdiv(end, bs) <= len(table) <= m:
        raise ValueError(f"seq {seq.request_id!r}: block_table has {len(table)} blocks; "
                         f"positions < {end} need {cdiv(end, bs)}, max_blocks_per_seq={m}")
    if table and not (0 <= min(table) and max(table) < cache_config.num_blocks):
        raise ValueError(f"seq {seq.request_id!r}: block_table {table} has ids outside "
                         f"[0, num_blocks={cache_config.num_blocks})")
    if NULL_BLOCK in table[seq.start_pos // bs:cdiv(end, bs)]:
        raise ValueError(f"seq {seq.request_id!r}: block_table {table} has the null block "
                         f"where positions [{seq.start_pos}, {end}) are written")
