"""What the bench scripts share. Not a jaxkv module: a script puts bench/ on sys.path and
imports ``lib.<module>``::

    sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/ (experiments: parents[1])
    from lib.step_timing import loadavg  # noqa: E402

* ``step_timing``: the load average, one engine step's host vs device time, alternating timings.
* ``ragged_batches``: ragged block tables, seq_lens and query_start_loc for one attention layer.
* ``random_model``: HF Llama directories of random weights with a word-level tokenizer.
* ``vllm_peer``: vLLM's CPU build as a peer (its version shim, worker environment, ``LLM``).
"""
