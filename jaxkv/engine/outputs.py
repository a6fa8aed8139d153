"""What the engine returns: vLLM-shaped ``RequestOutput`` / ``CompletionOutput`` and per-request metrics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter`` seconds) of one request.

    Attributes:
      arrival_time: when the request was added.
      first_scheduled_time: when its first tokens were computed (None before).
      first_token_time: when its first output token was sampled (None before).
      last_token_time: when its latest output token was sampled (None before).
      finished_time: when it finished (None while running).
      num_generated_tokens: output tokens so far (over all ``n`` samples).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, seconds (None with fewer than 2 tokens)."""
        if self.finished_time is None or self.first_token_time is None \
                or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish, seconds."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
      index: which of the request's ``n`` samples.
      text: decoded output (stop strings trimmed). While running it holds back what may still
        change (an incomplete UTF-8 character, and the last ``max(len(stop)) - 1`` characters a
        stop string could still trim), so it only grows until the final text.
      token_ids: generated token ids (a stop token is kept).
      cumulative_logprob: sum of the chosen tokens' logprobs.
      logprobs: per token, ``{token_id: logprob}`` of the top-N tokens and the chosen one, when
        ``SamplingParams.logprobs`` is set; else None.
      finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` (this request failed
        inside a step; see ``RequestOutput.error``) or None while running.
      stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's prompt, its ``n`` completions and its metrics.

    Attributes:
      request_id: the engine's id of the request.
      prompt: the prompt text (None when given as token ids).
      prompt_token_ids: the tokenized prompt.
      outputs: one ``CompletionOutput`` per sample, by index.
      metrics: timestamps, TTFT and TPOT.
      num_cached_tokens: prompt tokens taken from the prefix cache at admission (not
        computed); None before the request is scheduled.
      error: why the request failed (its completions have ``finish_reason="error"``); None
        otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    num_cached_tokens: int | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
