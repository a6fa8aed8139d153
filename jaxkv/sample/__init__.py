"""Sampling inside the jitted step: ``SamplingParams`` and the batched sampler (temperature,
top-k/p, min-p, penalties, logprobs), and the rejection sampler that verifies drafts."""
