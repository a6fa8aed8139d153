"""The OpenAI-compatible HTTP server (``jaxkv serve``)::

    protocol.py  request models (OpenAI fields + vLLM's extensions; unknown or unsupported fields
                 are 400s) -> SamplingParams, and the response / stream-chunk / error bodies
    prompts.py   prompts tokenized off the event loop, refused early when over max_model_len
    tools.py     tools / tool_choice -> the grammar or parser of the calls; tools in the prompt
    tool_calls.py  the parsers of calls in an answer; tool_calls whole and as stream deltas
    gate.py      the ASGI gate: 503 + Retry-After while draining, 401 without the key, 413 over
                 --max-request-bytes
    metrics.py   Prometheus metrics under vLLM's names, labelled model_name
    app.py       the FastAPI app over one AsyncLLM, and ``serve`` (uvicorn, SIGTERM drain)
"""
