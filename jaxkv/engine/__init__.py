"""The engine, in layers (arrows point down; nothing below imports what is above)::

    llm.py            LLM: synchronous facade; per-request output queues, streams, generate, chat
    async_llm.py      AsyncLLM: one background device thread, asyncio queues per request
    data_parallel.py  DataParallelLLM: engine replicas, one per device group
    beam_search.py    beam search over the engine's forks
    core.py           EngineCore: the only step loop (add / abort / step -> outputs by request id)
    requests.py       the engine's per-request state; outputs.py, detokenize.py what it returns
"""
