"""GPU attention kernels (Pallas) over the paged KV cache; the specs live in jaxkv.attention.reference.

Backend: both kernels use Pallas' Triton lowering (explicit ``plgpu.CompilerParams``), which
runs in interpret mode on CPU and lowers to CUDA without a GPU. The backend choice stays inside
this package: a Mosaic GPU (Hopper) kernel would sit next to these files behind the same calls.

* ``ragged_paged_attention``: one launch for a ragged step (prefill chunks + decode tokens).
* ``paged_decode_attention``: one token per sequence, split-K (flash-decoding) + LSE merge;
  ``decode_step_attention`` runs a decode-only ragged step through it (the engine's decode steps).
* ``sparse_paged_decode_attention``: one token per sequence over selected pages only (Quest).

The three share kv_walk.py's tile walk; without a sliding window the first two walk only the
kept (non-null) blocks of each table row.
"""

from jaxkv.attention.pallas.decode import (DecodeConfig, decode_step_attention,
                                           default_num_splits, paged_decode_attention,
                                           target_sm_count)
from jaxkv.attention.pallas.ragged import (RaggedConfig, check_page_ids, default_ragged_config,
                                           ragged_paged_attention)
from jaxkv.attention.pallas.sparse import SparseConfig, sparse_paged_decode_attention

__all__ = [
    "DecodeConfig",
    "RaggedConfig",
    "SparseConfig",
    "check_page_ids",
    "decode_step_attention",
    "default_num_splits",
    "default_ragged_config",
    "paged_decode_attention",
    "ragged_paged_attention",
    "sparse_paged_decode_attention",
    "target_sm_count",
]
