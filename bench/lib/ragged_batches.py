"""Ragged batch metadata for one attention layer: block tables from a random permutation of page
ids (a kernel that reads the wrong page is not hidden by neighbouring pages), seq_lens and
query_start_loc with padding sequences. The attention tests use it too (tests/conftest.py puts
the repository root on sys.path; bench/ never puts tests/ there)."""

import jax.numpy as jnp
import numpy as np


def table_batch(rng, q_lens, kv_lens, *, T, S, max_blocks, num_blocks, bs):
    """int32 block tables [S, max_blocks] (blocks of a random permutation of 1..num_blocks-1,
    padding 0), seq_lens [S] and query_start_loc [S + 1] (padding sequences have q_len 0)."""
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((S, max_blocks), np.int32)
    used = 0
    for s, n in enumerate(kv_lens):
        nb = -(-n // bs)
        tables[s, :nb] = perm[used:used + nb]
        used += nb
    qsl = np.full(S + 1, sum(q_lens), np.int32)
    qsl[0] = 0
    qsl[1:len(q_lens) + 1] = np.cumsum(q_lens)
    lens = np.zeros(S, np.int32)
    lens[:len(kv_lens)] = kv_lens
    assert sum(q_lens) <= T
    return jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(qsl)
