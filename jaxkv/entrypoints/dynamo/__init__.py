"""jaxkv as an NVIDIA Dynamo backend: ``python -m jaxkv.entrypoints.dynamo [flags]``.

``engine.py`` (``JaxkvEngine``, Dynamo's ``LLMEngine`` over one ``AsyncLLM``), ``args.py``
(Dynamo's runtime flags + jaxkv's engine flags), ``protocol.py`` (Dynamo's token requests and
chunks), ``model_card.py`` (the tokenizer files Dynamo registers). Dynamo is optional: only
``engine.py`` and ``args.py`` import it, through ``require_dynamo``.

Design notes and the deployment recipe: docs/dynamo.md.
"""

from __future__ import annotations

EXTRA = "pip install 'jaxkv[dynamo]'"


def require_dynamo() -> None:
    """Raises an ``ImportError`` naming the extra when Dynamo (``ai-dynamo``) is missing."""
    try:
        import dynamo.common.backend  # noqa: F401
        import dynamo.llm  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the jaxkv Dynamo backend needs NVIDIA Dynamo (ai-dynamo and "
                          f"ai-dynamo-runtime 1.6): {EXTRA} ({e})") from None
