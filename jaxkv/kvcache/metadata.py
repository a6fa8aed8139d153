"""AttentionMetadata: the int32 arrays that describe one ragged step to the device.

Built on the host (jaxkv/runner/batch.py) and padded to a bucket, so the jitted step sees a fixed
set of shapes. T = padded token count, S = padded sequence count, B = max blocks per sequence.
See jaxkv/attention/reference.py for the ragged layout and jaxkv/kvcache/pages.py for slots and block tables.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax


@partial(jax.tree_util.register_dataclass,
         data_fields=["slot_mapping", "query_start_loc", "seq_lens", "block_tables", "num_drafts",
                      "group_slot_mapping", "group_block_tables"],
         meta_fields=["decode_only"])
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to.

    Attributes:
      slot_mapping: int32 [T] ``block_id * block_size + offset`` of each token (padding -> block 0).
      query_start_loc: int32 [S + 1] cumulative query lengths (padding sequences have q_len 0).
      seq_lens: int32 [S] kv length of each sequence including this step's tokens (padding 0).
      block_tables: int32 [S, B] physical block ids (padding 0, the null block).
      num_drafts: optional int32 [S]: how many of each sequence's query tokens are speculative
        drafts (its last ones; jaxkv/runner/batch.py); None: no drafts. Quest attends drafts
        sparsely as the decode steps they stand for (``jaxkv.attention.quest.sparse_rows``).
      group_slot_mapping, group_block_tables: optional int32 [G - 1, T] and [G - 1, S, B]: a
        hybrid cache's slots and tables of groups 1, 2, ... (the fields above are group 0's;
        jaxkv/config/kv_groups.py); ``for_group`` gives one group's metadata.
      decode_only: static: a promise that the step is decode-only, every sequence at most one
        query token and sequence s's the s-th (``query_start_loc[s] = s`` up to the padding
        sequences). The Pallas path then runs split-K decode (jaxkv/attention/dispatch.py).
    """

    slot_mapping: jax.Array     # [T]
    query_start_loc: jax.Array  # [S + 1]
    seq_lens: jax.Array         # [S]
    block_tables: jax.Array     # [S, B]
    num_drafts: jax.Array | None = None  # [S]
    group_slot_mapping: jax.Array | None = None   # [G - 1, T]
    group_block_tables: jax.Array | None = None   # [G - 1, S, B]
    decode_only: bool = False

    def for_group(self, g: int) -> AttentionMetadata:
        """Group ``g``'s metadata: its slots and block tables, no group arrays."""
        slots, tables = ((self.slot_mapping, self.block_tables) if g == 0 else
                         (self.group_slot_mapping[g - 1], self.group_block_tables[g - 1]))
        return dataclasses.replace(self, slot_mapping=slots, block_tables=tables,
                                   group_slot_mapping=None, group_block_tables=None)
