"""Tensor parallelism: logical axis rules -> ``NamedSharding``s over a ``Mesh(("dp", "tp"))``.

An MLA model (DeepSeek) splits its query heads: ``q_proj`` / ``q_b_proj``, ``kv_b_proj``'s
W_UK and W_UV and the row-parallel ``o_proj`` by their "heads" axis, the down-projections to
the latent (``q_a_proj``, ``kv_a_proj``) replicated; its one latent kv head, which every query
head reads, is held whole on every device (``cache_specs``) rather than repeated (MQA's
``tp_config``): each device writes its copy and attends its heads over it (``ShardedAttention.
over_heads``). Design notes: docs/runtime.md."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.attention.dispatch import paged_attention
from jaxkv.kvcache.pages import PagedKVCache, abstract_cache
from jaxkv.kvcache.pages import logical_axes as cache_logical_axes
from jaxkv.kvcache.pools import HNDPages
from jaxkv.kvcache.spec import KVCacheSpec
from jaxkv.model import quantize
from jaxkv.model.config import ModelConfig
from jaxkv.model.llama import logical_axes
from jaxkv.model.quantization import BLOCK
from jaxkv.model.quantized import QuantizedWeight
from jaxkv.runner.device_shares import kv_replication, tp_config

MESH_AXES = ("dp", "tp")

# logical axis name -> mesh axis (None: replicated). The only place mesh axes are named.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", "tp"), ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"),
    ("embed", None), ("head_dim", None), ("norm", None), ("experts", None))


def _split_problems(config: ModelConfig, n: int) -> list[str]:
    """Why ``config`` cannot be split over ``n`` tp devices (empty when it can)."""
    out = []
    for name, size in (("num_heads", config.num_heads), ("intermediate_size",
                       config.intermediate_size), ("vocab_size", config.vocab_size),
                       ("moe_intermediate_size", config.expert_size),
                       ("draft_vocab_size", config.draft_vocab_size or n)):
        if size % n:
            out.append(f"{name}={size} is not divisible by {n}")
    kv = config.num_kv_heads
    if kv % n and n % kv:
        out.append(f"num_kv_heads={kv} neither divides nor is divisible by {n}")
    return out


def valid_tensor_parallel_sizes(config: ModelConfig, max_size: int) -> list[int]:
    """Every tp degree in ``[1, max_size]`` the model splits over (heads, mlp, vocab divisible)."""
    return [n for n in range(1, max_size + 1) if not _split_problems(config, n)]


def check_parallel_sizes(config: ModelConfig, tensor_parallel_size: int,
                         data_parallel_size: int = 1, *, num_devices: int) -> None:
    """Validates the parallel layout before any weight is loaded.

    Raises:
      ValueError: naming ``tensor_parallel_size`` / ``data_parallel_size`` when a size is < 1,
        when ``tensor_parallel_size x data_parallel_size`` exceeds ``num_devices``, or when the
        model's heads/mlp/vocab cannot be split (listing the valid sizes).
    """
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("data_parallel_size", data_parallel_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if tensor_parallel_size * data_parallel_size > num_devices:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size="
            f"{data_parallel_size} needs {tensor_parallel_size * data_parallel_size} devices, "
            f"only {num_devices} are available")
    problems = _split_problems(config, tensor_parallel_size)
    if problems:
        valid = valid_tensor_parallel_sizes(config, max(num_devices, tensor_parallel_size))
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} cannot split this model: "
            f"{'; '.join(problems)}; valid sizes (up to {max(num_devices, tensor_parallel_size)}"
            f" devices): {', '.join(map(str, valid))}")


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1,
              devices=None) -> Mesh:
    """A ``Mesh`` of shape ``(data_parallel_size, tensor_parallel_size)`` with axes ("dp", "tp").

    Args:
      tensor_parallel_size, data_parallel_size: mesh shape.
      devices: the devices to use, in order (default ``jax.devices()``, all processes'); the
        first ``dp x tp`` are taken, tp varying fastest (neighbouring devices share a replica).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = tensor_parallel_size * data_parallel_size
    if n > len(devices):
        raise ValueError(f"tensor_parallel_size x data_parallel_size = {n} exceeds the "
                         f"{len(devices)} devices")
    grid = np.array(devices[:n], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, MESH_AXES)


def check_mesh(mesh: Mesh, tensor_parallel_size: int) -> None:
    """Raises ValueError naming ``mesh`` unless it is an engine mesh ``{"dp": 1, "tp": N}``."""
    shape = dict(mesh.shape)
    if tuple(mesh.axis_names) != MESH_AXES or shape != {"dp": 1, "tp": tensor_parallel_size}:
        raise ValueError(f"mesh={shape} does not match an engine mesh "
                         f"{{'dp': 1, 'tp': {tensor_parallel_size}}} with axes {MESH_AXES} "
                         f"(tensor_parallel_size={tensor_parallel_size})")


def spec(axes: tuple[str | None, ...], *, rules=LOGICAL_AXIS_RULES) -> P:
    """``PartitionSpec`` of an array whose dimensions carry logical ``axes`` (None: replicated)."""
    table = dict(rules)
    for a in axes:
        if a is not None and a not in table:
            raise ValueError(f"logical axis {a!r} has no rule in {sorted(table)}")
    return P(*(None if a is None else table[a] for a in axes))


def param_specs(config: ModelConfig, *, rules=LOGICAL_AXIS_RULES) -> dict:
    """Nested dict (params structure) of each parameter's ``PartitionSpec``."""
    return jax.tree.map(lambda axes: spec(axes, rules=rules), logical_axes(config),
                        is_leaf=lambda x: isinstance(x, tuple))


def param_shardings(config: ModelConfig, mesh: Mesh, *, rules=LOGICAL_AXIS_RULES) -> dict:
    """Nested dict (params structure) of each parameter's ``NamedSharding`` on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(config, rules=rules),
                        is_leaf=lambda x: isinstance(x, P))


def cache_specs(tree, *, rules=LOGICAL_AXIS_RULES):
    """The ``PartitionSpec`` of every array of a cache, a pool or a ``QuantizedPages`` (arrays,
    tracers or ``jax.ShapeDtypeStruct``s), in the same structure: pool-shaped arrays (float
    pages, codes, scales, zero points, the KIVI residual) split over their kv-head axis, the
    KIVI bookkeeping replicated (``jaxkv.kvcache.pages.logical_axes``; an ``HNDPages`` over the head
    axis of its data). An array of ONE kv head is replicated: only an MLA latent pool has one at
    tp > 1 (fewer kv heads than devices are otherwise repeated, ``tp_config``), and every query
    head reads all of it."""
    def leaf_spec(x):
        axes = cache_logical_axes(x)
        if "kv_heads" in axes and _array_shape(x)[axes.index("kv_heads")] == 1:
            axes = tuple(None if a == "kv_heads" else a for a in axes)
        out = spec(axes, rules=rules)
        return HNDPages(out) if isinstance(x, HNDPages) else out

    return jax.tree.map(leaf_spec, tree, is_leaf=lambda x: isinstance(x, HNDPages))


def _array_shape(x) -> tuple[int, ...]:
    """The stored shape of a cache leaf (an ``HNDPages``' data, [N, Hkv, bs, D])."""
    return x.data.shape if isinstance(x, HNDPages) else x.shape


def cache_shardings(cache: PagedKVCache | KVCacheSpec, mesh: Mesh, *,
                    rules=LOGICAL_AXIS_RULES) -> PagedKVCache:
    """A PagedKVCache of ``NamedSharding``s for ``cache`` (or the cache a ``KVCacheSpec``
    describes, ``jaxkv.kvcache.pages.init_cache(spec, shardings)``), any format: see
    ``cache_specs``.

    ``num_kv_heads`` of the spec is the (possibly replicated, ``tp_config``) total; each device
    holds ``num_kv_heads // tp`` heads of every pool-shaped array.
    """
    if isinstance(cache, KVCacheSpec):
        cache = abstract_cache(cache)
    return jax.tree.map(lambda p: NamedSharding(mesh, p), cache_specs(cache, rules=rules))


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated sharding (step inputs, sampled tokens)."""
    return NamedSharding(mesh, P())


def _restore_rules(config: ModelConfig, tensor_parallel_size: int):
    """Rules for the *stored* (unreplicated) params: kv heads whole when they get repeated."""
    if kv_replication(config, tensor_parallel_size) == 1:
        return LOGICAL_AXIS_RULES
    return tuple((a, None if a == "kv_heads" else m) for a, m in LOGICAL_AXIS_RULES)


def stored_param_shardings(config: ModelConfig, mesh: Mesh, params: dict | None = None) -> dict:
    """Shardings to load a checkpoint of ``config`` (the original kv head count) into.

    Same as ``param_shardings`` except that k/v heads stay whole on each device when
    ``shard_params`` will repeat them (kv heads < tp). ``params``: the tree to restore (shape
    structs), whose ``QuantizedWeight``s get their arrays' shardings (``quantized_specs``).
    """
    rules = _restore_rules(config, mesh.shape["tp"])
    if params is None:
        return param_shardings(config, mesh, rules=rules)
    return _shardings(params, config, mesh, rules)


def _row_col_axes(w: QuantizedWeight, axes: tuple, name: str) -> tuple[tuple, tuple]:
    """(logical axes of the stored rows N, of the stored columns K) of ``w``: the embedding
    [V, E] is stored as read, a linear weight ``[K..., N...]`` transposed (``out_shape``), a
    stack of experts ``[X, K, N]`` as X weights [N, K]."""
    if name == "embed_tokens":
        return axes[:1], axes[1:]
    if w.stacked:
        return axes[2:], axes[1:2]
    n = len(w.out_shape())
    return axes[len(axes) - n:], axes[:len(axes) - n]


def _mesh_axis(axes: tuple, rules) -> str | None:
    """The mesh axis one stored axis (the flattened logical ``axes``) is split over, or None."""
    return next((m for m in spec(axes, rules=rules) if m is not None), None)


def _check_k_split(name: str, n: int, k: int, group: int, tp: int) -> None:
    """Raises ValueError naming ``quantization_group_size`` and tensor ``name`` [n, k] unless
    ``tp`` devices each get whole groups of K (or whole 32-value blocks with one group a row)."""
    per = k // tp
    if k % tp or per % BLOCK or (k > group and per % group):
        raise ValueError(
            f"tensor {name!r} [{n}, {k}] split over tensor_parallel_size={tp} devices along K "
            f"gives {k / tp:g} values a row each, which cuts its groups of {min(group, k)} "
            f"(quantization_group_size; each device needs whole groups, a multiple of {BLOCK})")


def quantized_specs(w: QuantizedWeight, axes: tuple, name: str, mesh: Mesh, *,
                    rules=LOGICAL_AXIS_RULES) -> QuantizedWeight:
    """``w`` with a ``PartitionSpec`` for each array: qs, d and m split along their rows where
    N is split (column-parallel: q, k, v, gate, up, the embedding, the head); qs split along K
    where K is (row-parallel: o, down), d and m with it (whole groups on each device) or
    replicated (one scale per row, G == 1); a stack of experts by its experts' rule, the
    experts' axis as ``rules`` place it. Raises ``_check_k_split``'s ValueError."""
    row_axes, col_axes = _row_col_axes(w, axes, name)
    rows, cols = _mesh_axis(row_axes, rules), _mesh_axis(col_axes, rules)
    lead = (_mesh_axis(axes[:1], rules),) if w.stacked else ()
    scales = P(*lead, rows, None)
    if cols is not None:
        _check_k_split(name, w.rows, w.cols, w.group, mesh.shape[cols])
        scales = scales if w.d.shape[-1] == 1 else P(*lead, rows, cols)
    return dataclasses.replace(w, qs=P(*lead, rows, cols), d=scales,
                               m=None if w.m is None else scales)


def check_quantized_split(config: ModelConfig, group: int | None,
                          tensor_parallel_size: int, *, only_experts: bool = False) -> None:
    """``_check_k_split`` of the row-parallel projections (o_proj K = Hq x D, an MLA model's
    Hq x V; down_proj K = F where the model has dense MLPs, an expert's K = its width)
    quantized in groups of ``group`` (None: one scale per row), before any weight loads;
    ``only_experts``: only the experts are quantized (an MXFP4 checkpoint's)."""
    v = config.mla.v_head_dim if config.mla else config.head_dim     # o_proj's input per head
    split = [] if only_experts else [("o_proj", config.num_heads * v)]
    if not only_experts and (not config.num_experts or config.dense_layers):
        split.append(("down_proj", config.intermediate_size))
    if only_experts or quantize.experts_quantized(config):
        split.append(("experts' down_proj", config.expert_size))
    for name, k in split:
        _check_k_split(name, config.hidden_size, k, group or k, tensor_parallel_size)


def _shardings(params: dict, config: ModelConfig, mesh: Mesh, rules) -> dict:
    """``params``' shardings (arrays, or ``QuantizedWeight``s of arrays or shape structs) by
    the logical axes of ``config``'s params."""
    def one(path, axes, x):
        if isinstance(x, QuantizedWeight):
            s = quantized_specs(x, axes, path[-1].key, mesh, rules=rules)
            return jax.tree.map(lambda p: NamedSharding(mesh, p), s,
                                is_leaf=lambda p: isinstance(p, P))
        return NamedSharding(mesh, spec(axes, rules=rules))

    return jax.tree_util.tree_map_with_path(one, logical_axes(config), params,
                                            is_leaf=lambda x: isinstance(x, tuple))


def _repeat_kv(x, axes: tuple, r: int):
    """A k / v param with each kv head repeated ``r`` times: a float array along its
    "kv_heads" axis, a ``QuantizedWeight``'s rows [Hkv x D] (heads major) as [Hkv x r x D]."""
    a = axes.index("kv_heads")
    if not isinstance(x, QuantizedWeight):
        return jnp.repeat(x, r, axis=a)
    h = x.shape[a]

    def rows(q):                                            # [Hkv * D, C] -> [Hkv * r * D, C]
        return jnp.repeat(q.reshape(h, -1, q.shape[1]), r, axis=0).reshape(-1, q.shape[1])

    return dataclasses.replace(x.map_rows(rows),
                               shape=x.shape[:a] + (h * r,) + x.shape[a + 1:])


def shard_params(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """Places params of ``config`` on ``mesh`` by the rules, repeating kv heads if needed.

    Args:
      params: nested dict of numpy or jax arrays (or ``QuantizedWeight``s of them, split by
        ``quantized_specs``) shaped like ``param_shapes(config)``; jax arrays already in
        their stored sharding (e.g. from an orbax restore) stay put.
      config: the model's original config.
      mesh: an engine mesh.

    Returns:
      Params shaped like ``param_shapes(tp_config(config, tp))`` in ``param_shardings`` of it.
      Each process only reads the slices its own devices hold (multi-host safe).
    """
    tp = mesh.shape["tp"]
    stored = _shardings(params, config, mesh, _restore_rules(config, tp))

    def place(x, s):
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    params = jax.tree.map(place, params, stored)
    r = kv_replication(config, tp)
    if r == 1:
        return params

    def repeat(p):
        return jax.tree.map(lambda a, x: _repeat_kv(x, a, r) if "kv_heads" in a else x,
                            logical_axes(config), p, is_leaf=lambda x: isinstance(x, tuple))

    target = _shardings(jax.eval_shape(repeat, params), tp_config(config, tp), mesh,
                        LOGICAL_AXIS_RULES)
    return jax.jit(repeat, out_shardings=target)(params)


def sharded_attention(mesh: Mesh, *, rules=LOGICAL_AXIS_RULES) -> "ShardedAttention":
    """``paged_attention`` run under ``shard_map`` on each device's kv-head shard
    (``ShardedAttention``)."""
    return ShardedAttention(mesh, rules)


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """``paged_attention``'s signature, run under ``shard_map`` on each device's heads.

    q [T, Hq, D] is split over heads and the pools [num_blocks, block_size, Hkv, D] over kv
    heads, so each device attends its ``Hq/tp`` q heads over its ``Hkv/tp`` kv heads (the GQA
    groups stay whole); metadata is replicated. A quantized pool (``QuantizedPages``) is split
    the same way (``cache_specs``): each device reads its heads' codes, scales, zero points and
    KIVI residual, with the per-block bookkeeping replicated; a one-head (MLA latent) pool is
    whole on every device. With ``return_lse=True`` the lse f32 [T, heads] comes back split
    over heads like the output (a scoring retention policy's block mass reads it).
    """

    mesh: Mesh
    rules: tuple = LOGICAL_AXIS_RULES

    def _heads(self) -> P:
        return P(None, *spec(("heads", "head_dim"), rules=self.rules))   # [T, heads, head_dim]

    def __call__(self, q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, *,
                 q_sinks=None, return_lse=False, **kw):
        q_spec = self._heads()
        pool_specs = cache_specs((k_pages, v_pages), rules=self.rules)
        extra = () if q_sinks is None else (q_sinks,)   # split over heads like q

        def local(q, k, v, tables, lens, qsl, *qs):
            return paged_attention(q, k, v, tables, lens, qsl, return_lse=return_lse, **kw,
                                   **({"q_sinks": qs[0]} if qs else {}))

        out_specs = (q_spec, P(*q_spec[:2])) if return_lse else q_spec
        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(q_spec, *pool_specs, P(), P(), P(), *[q_spec] * len(extra)),
                           out_specs=out_specs, check_vma=False)
        return fn(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, *extra)

    def over_heads(self, fn, heads: tuple, pool, shared):
        """``fn(*heads, pool, shared)`` on each device's query heads (MLA's attention, every
        form and kernel run per device): ``heads`` are arrays with the heads on axis 1 (q
        [T, N, .], W_UK / W_UV [Lkv, N, .]), split over them; ``pool`` split as the cache
        (``cache_specs``: a latent pool whole); ``shared`` (a pytree: the step's metadata)
        replicated. ``fn`` returns [T, N, .], gathered back split over heads."""
        h = self._heads()
        return jax.shard_map(fn, mesh=self.mesh,
                             in_specs=(*[h] * len(heads), cache_specs(pool, rules=self.rules),
                                       P()), out_specs=h, check_vma=False)(*heads, pool, shared)


def put_replicated(tree, mesh: Mesh):
    """Host values (numpy / python scalars, identical on every process) as replicated arrays."""
    s = replicated(mesh)

    def put(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree.map(put, tree)


def to_host(x: jax.Array) -> np.ndarray:
    """A fully replicated array as numpy, read from this process's first shard (multi-host safe)."""
    return np.asarray(x.addressable_shards[0].data)


def count_all_reduces(hlo_text: str) -> int:
    """Number of all-reduce ops (sync or async start) in compiled HLO text."""
    return len(re.findall(r"=\s*\S+\s+all-reduce(?:-start)?\(", hlo_text))


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """Joins a multi-host run through ``jax.distributed.initialize`` (call before any jax use).

    Every process runs the same program on the same inputs; the host scheduler is a pure
    function, so each process computes the identical plan and feeds its own devices (no plan
    broadcast). ``coordinator_address`` defaults to the ``JAX_COORDINATOR_ADDRESS`` env var
    (jax's own); ``num_processes`` / ``process_id`` are required outside auto-detected clusters
    (SLURM, Open MPI, TPU, ...). CLI: ``--coordinator-address``, ``--num-processes``,
    ``--process-id``.
    """
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
