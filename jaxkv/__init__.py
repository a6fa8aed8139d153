"""jaxkv: a JAX/Pallas LLM inference engine built around paged KV-cache memory management.

The public API is small: ``LLM`` and ``AsyncLLM`` (the engine facades), ``EngineCore``
(the step loop), ``SamplingParams``, the outputs, the configs and
the memory planner. The names are imported on first use, so ``import jaxkv.attention.pallas`` (the
GPU check on a machine with only jax and numpy) does not pull in flax, the tokenizer or tqdm.
Importing jaxkv never imports torch or transformers.
"""

import importlib

_EXPORTS = {
    "LLM": "jaxkv.engine.llm",
    "AsyncLLM": "jaxkv.engine.async_llm",
    "EngineCore": "jaxkv.engine.core",
    "DataParallelLLM": "jaxkv.engine.data_parallel",
    "EngineConfig": "jaxkv.config",
    "SamplingParams": "jaxkv.sample.sampler",
    "RequestOutput": "jaxkv.engine.outputs",
    "CompletionOutput": "jaxkv.engine.outputs",
    "RequestMetrics": "jaxkv.engine.outputs",
    "BeamSearchParams": "jaxkv.engine.beam_search",
    "BeamSearchOutput": "jaxkv.engine.beam_search",
    "CacheConfig": "jaxkv.config",
    "SchedulerConfig": "jaxkv.config",
    "ModelConfig": "jaxkv.model.config",
    "MemoryPlan": "jaxkv.runner.memory_plan",
    "plan": "jaxkv.runner.memory_plan",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")


def __dir__():
    return sorted(__all__ + ["__version__"])
