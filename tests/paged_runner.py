"""A minimal single-sequence driver of ``forward`` over a paged cache, for model tests.

It allocates blocks from a random permutation of page ids (never accidentally contiguous) and
feeds the prompt in chunks, then decodes greedily one token at a time.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cache as kvcache
from jaxkv.metadata import AttentionMetadata
from jaxkv.model.llama import forward


class PagedRunner:
    def __init__(self, params, config, *, block_size=4, max_len=128, seed=0,
                 attention_impl="reference", interpret=False):
        self.params, self.config, self.bs = params, config, block_size
        self.max_blocks = -(-max_len // block_size)
        num_blocks = self.max_blocks + 3
        rng = np.random.default_rng(seed)
        self.table = rng.permutation(np.arange(1, num_blocks))[: self.max_blocks].astype(np.int32)
        dtype = jax.tree_util.tree_leaves(params)[0].dtype
        self.cache = kvcache.init_cache(config.num_layers, num_blocks, block_size,
                                        config.num_kv_heads, config.head_dim, dtype)
        self.len = 0
        self._fwd = jax.jit(lambda p, t, pos, c, md: forward(
            p, t, pos, c, md, config=config, attention_impl=attention_impl, interpret=interpret),
            donate_argnums=3)

    def feed(self, token_ids):
        """Appends tokens; returns float32 logits [len(token_ids), vocab] for them."""
        n = len(token_ids)
        pos = np.arange(self.len, self.len + n, dtype=np.int32)
        slots = self.table[pos // self.bs] * self.bs + pos % self.bs
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots, jnp.int32),
            query_start_loc=jnp.asarray([0, n], jnp.int32),
            seq_lens=jnp.asarray([self.len + n], jnp.int32),
            block_tables=jnp.asarray(self.table[None, :], jnp.int32))
        logits, self.cache = self._fwd(self.params, jnp.asarray(token_ids, jnp.int32),
                                       jnp.asarray(pos), self.cache, md)
        self.len += n
        return np.asarray(logits)

    def prefill(self, prompt, chunk=None):
        chunk = chunk or len(prompt)
        outs = [self.feed(prompt[i:i + chunk]) for i in range(0, len(prompt), chunk)]
        return np.concatenate(outs)

    def greedy(self, prompt, max_new, chunk=None):
        """Returns (new token ids, logits of every step [max_new, vocab])."""
        last = self.prefill(prompt, chunk)[-1]
        tokens, steps = [], []
        for _ in range(max_new):
            steps.append(last)
            tok = int(np.argmax(last))
            tokens.append(tok)
            last = self.feed([tok])[-1]
        return tokens, np.stack(steps)
