"""The engine, in layers (arrows point down; nothing below imports what is above)::

    llm.py        LLM: synchronous facade; per-request output queues, streams, generate, chat
    async_llm.py  AsyncLLM: one background device thread, asyncio queues per request
    core.py       EngineCore: the only step loop (add / abort / step -> outputs by request id)
    runner.py     ModelRunner: params, the donated KV cache and the jitted step
"""
