"""The weight-quantization methods of ``LLM(quantization=...)`` and their group size, checked
where the config is built (no jax here: the config imports it; quantize.py quantizes)."""

from __future__ import annotations

METHODS = ("int8", "fp8", "int4")          # besides None (as stored) and "none" (dequantized)
DEFAULT_GROUP = 128                        # int4's values per scale (llm-compressor's W4A16)
BLOCK = 32                                 # the kernels' blocks: groups are multiples


def scale_group(method: str, group: int) -> int | None:
    """Values per scale of ``method``: ``group`` for int4, None (one per output channel) for
    int8 and fp8."""
    return group if method == "int4" else None


def check_group(group: int) -> None:
    """Raises ValueError naming ``quantization_group_size`` unless it is a positive multiple
    of 32 (the kernels' nibble blocks)."""
    if not isinstance(group, int) or group <= 0 or group % BLOCK:
        raise ValueError(f"quantization_group_size={group!r}: must be a positive multiple of "
                         f"{BLOCK}")
