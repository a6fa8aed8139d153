"""The Dynamo worker's command line: Dynamo's runtime flags (``--discovery-backend``,
``--namespace``, ``--endpoint``, ``--request-plane`` ... with their ``DYN_*`` variables), the
worker's own (``--served-model-name``), every jaxkv engine flag (``EngineConfig``) and the
multi-host launch flags (``jaxkv serve``'s)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from jaxkv.config import EngineConfig
from jaxkv.entrypoints.cli import add_launch_args, launch_kwargs
from jaxkv.entrypoints.dynamo import require_dynamo

require_dynamo()

from dynamo.common.backend.worker import WorkerConfig  # noqa: E402
from dynamo.common.configuration.groups.runtime_args import (  # noqa: E402
    DynamoRuntimeArgGroup,
    DynamoRuntimeConfig,
)
from dynamo.common.utils.runtime import parse_endpoint  # noqa: E402
from dynamo.llm import ModelInput  # noqa: E402

COMPONENT, ENDPOINT = "backend", "generate"   # Dynamo's defaults: dyn://<namespace>.backend.generate


@dataclasses.dataclass
class Parsed:
    """What ``parse`` returns: the engine's config, the name clients send, Dynamo's runtime
    config (endpoint resolved), whether KV routing is on, and ``jaxkv.engine.multihost.launch``'s
    keywords (None: one process)."""

    engine: EngineConfig
    served_model_name: str
    runtime: DynamoRuntimeConfig
    kv_routing: bool
    launch: dict | None

    def worker_config(self, model_path: str | Path) -> WorkerConfig:
        """Dynamo's ``WorkerConfig``; ``model_path`` is the directory whose tokenizer and
        chat template Dynamo registers (``model_card.py``)."""
        return WorkerConfig.from_runtime_config(
            self.runtime, model_name=str(model_path), served_model_name=self.served_model_name,
            model_input=ModelInput.Tokens, enable_kv_routing=self.kv_routing)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxkv.entrypoints.dynamo",
        description="A Dynamo worker (token in, token out) over one jaxkv engine.")
    DynamoRuntimeArgGroup().add_arguments(parser)
    g = parser.add_argument_group("jaxkv worker")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the --model name)")
    g.add_argument("--disable-kv-routing", action="store_true",
                   help="publish neither KV events nor load snapshots (the KV router then "
                        "predicts the caches from its own decisions)")
    EngineConfig.add_cli_args(parser)
    add_launch_args(parser, serving=True)
    return parser


def parse(argv: list[str] | None = None) -> Parsed:
    """Parses ``argv`` (default ``sys.argv[1:]``).

    Raises:
      SystemExit: a bad flag (argparse's message).
      TypeError, ValueError: a bad engine value, naming the flag.
    """
    ns = build_parser().parse_args(argv)
    engine = EngineConfig.from_cli(ns)
    if engine.parallel.data_parallel_size > 1:
        raise ValueError("--data-parallel-size: a Dynamo worker runs one engine; start one "
                         "worker per replica (Dynamo's router balances them)")
    served = ns.served_model_name or Path(str(engine.model.model)).stem
    runtime = DynamoRuntimeConfig.from_cli_args(ns)
    runtime.validate()
    namespace, component, endpoint = parse_endpoint(
        runtime.endpoint or f"dyn://{runtime.namespace}.{COMPONENT}.{ENDPOINT}")
    runtime.namespace, runtime.component, runtime.endpoint = namespace, component, endpoint
    return Parsed(engine, served, runtime, not ns.disable_kv_routing, launch_kwargs(ns))
