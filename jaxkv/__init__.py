"""jaxkv: a JAX/Pallas LLM inference engine built around paged KV-cache memory management.

The public API is small: ``LLM`` (the engine), ``SamplingParams``, the outputs, the configs and
the memory planner. Importing jaxkv never imports torch or transformers.
"""

from jaxkv.config import CacheConfig, SchedulerConfig
from jaxkv.engine import LLM
from jaxkv.model.config import ModelConfig
from jaxkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxkv.planner import MemoryPlan, plan
from jaxkv.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "CacheConfig", "SchedulerConfig", "ModelConfig", "MemoryPlan", "plan"]
__version__ = "0.1.0"
