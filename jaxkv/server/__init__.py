"""The OpenAI-compatible HTTP server (``jaxkv serve``)::

    protocol.py  request models (OpenAI fields + vLLM's extensions) -> SamplingParams, and the
                 response / stream-chunk / error bodies
    metrics.py   Prometheus metrics under vLLM's names, labelled model_name
    app.py       the FastAPI app over one AsyncLLM, and ``serve`` (uvicorn, graceful SIGTERM)
"""
