"""Paged attention: one dispatch (dispatch.py) over the implementations: the pure-jnp reference
that is the spec, the grouped CPU path, the Pallas GPU kernels (pallas/), Quest's page selection
and the attention mass that H2O and SnapKV score with. This file imports nothing, so that
``import jaxkv.attention.pallas`` needs only jax, and the host-side config can name the
implementations."""

ATTENTION_IMPLS = ("reference", "grouped", "pallas")

