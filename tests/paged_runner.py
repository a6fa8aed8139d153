"""A minimal single-sequence driver of ``forward`` over a paged cache, for model tests.

It allocates blocks from a random permutation of page ids (never accidentally contiguous) and
feeds the prompt in chunks, then decodes greedily one token at a time. With a ``mesh`` it runs
the model tensor-parallel as the engine step does: params sharded by the logical axis rules, the
cache allocated into ``cache_shardings`` (any KV format), attention under ``shard_map``.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kvcache import pages as kvcache
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.spec import KVCacheSpec
from jaxkv.model.llama import forward
from jaxkv.runner import sharding


class PagedRunner:
    def __init__(self, params, config, *, block_size=4, max_len=128, seed=0,
                 attention_impl="reference", interpret=False, kv_cache_dtype="auto", mesh=None):
        self.bs = block_size
        self.max_blocks = -(-max_len // block_size)
        num_blocks = self.max_blocks + 3
        rng = np.random.default_rng(seed)
        self.table = rng.permutation(np.arange(1, num_blocks))[: self.max_blocks].astype(np.int32)
        dtype = jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype).name
        if mesh is not None:
            params = sharding.shard_params(params, config, mesh)
            config = sharding.tp_config(config, mesh.shape["tp"])   # kv heads as devices hold them
        self.params, self.config = params, config
        self.spec = KVCacheSpec(num_layers=config.num_layers, num_blocks=num_blocks,
                                block_size=block_size, num_kv_heads=config.num_kv_heads,
                                head_dim=config.head_dim, dtype=dtype,
                                kv_cache_dtype=kv_cache_dtype)
        shardings = None if mesh is None else sharding.cache_shardings(self.spec, mesh)
        attention = {} if mesh is None else {"attention": sharding.sharded_attention(mesh)}
        self.cache = kvcache.init_cache(self.spec, shardings)
        self.len = 0

        def step(p, t, pos, c, md):
            logits, c = forward(p, t, pos, c, md, config=config, attention_impl=attention_impl,
                                interpret=interpret, **attention)
            if shardings is not None:
                c = jax.lax.with_sharding_constraint(c, shardings)
            return logits, c

        self._fwd = jax.jit(step, donate_argnums=3)

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
