"""Prometheus metrics of the server under vLLM's names, so its dashboards and routers (the
Gateway API inference extension's endpoint picker, llm-d) read jaxkv unmodified.

Design notes: docs/server.md."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxkv.engine.outputs import RequestOutput
from jaxkv.engine.requests import FINISH_ERROR
from jaxkv.sched.state import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class _EngineCollector:
    """Reads the engine's gauges and counters at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], dict]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()
        label = [self.model_name]
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for family, name, doc, value in (
                (gauge, "vllm:num_requests_running",
                 "Requests with a sequence in the running batch.", s["num_requests_running"]),
                (gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                 s["num_requests_waiting"]),
                (gauge, "vllm:kv_cache_usage_perc", "Fraction of the KV blocks in use (1 = full).",
                 s["kv_usage"]),
                (counter, "vllm:num_preemptions", "Sequences preempted (recomputed later).",
                 s["num_preemptions"]),
                (counter, "vllm:prefix_cache_queries",
                 "Prompt tokens looked up in the prefix cache.", s["prefix_cache_queries"]),
                (counter, "vllm:prefix_cache_hits", "Of those, tokens found cached.",
                 s["prefix_cache_hits"]),
                (counter, "vllm:spec_decode_num_drafts", "Speculative: sequences that verified "
                 "drafts, once per step.", s["spec_num_drafts"]),
                (counter, "vllm:spec_decode_num_draft_tokens",
                 "Speculative: draft tokens verified.", s["spec_num_draft_tokens"]),
                (counter, "vllm:spec_decode_num_accepted_tokens",
                 "Speculative: draft tokens accepted.", s["spec_num_accepted_tokens"])):
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric(label, value)
            yield metric
        info = gauge("vllm:cache_config_info", "Information of the KV cache (value 1): block "
                     "size, pool blocks (the null block included).",
                     labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric(label + [str(s["block_size"]), str(s["num_gpu_blocks"])], 1.0)
        yield info
        if "kv_events_batches" in s:
            for name, doc, key in (
                    ("jaxkv:kv_events_batches", "KV-cache event batches queued to the publisher.",
                     "kv_events_batches"),
                    ("jaxkv:kv_events_dropped_batches", "KV-cache event batches dropped: the "
                     "publisher's queue was full.", "kv_events_dropped_batches")):
                metric = counter(name, doc, labels=["model_name"])
                metric.add_metric(label, s[key])
                yield metric
        if "kv_offload_blocks_total" not in s:
            return
        hits = counter("jaxkv:prefix_cache_hits_by_tier", "Prefix-cache hit tokens by the tier "
                       "that held them (device pool, host tier, persistent cache on disk).",
                       labels=["model_name", "tier"])
        host, disk = s["prefix_cache_hits_host"], s["prefix_cache_hits_disk"]
        for tier, value in (("device", s["prefix_cache_hits"] - host), ("host", host - disk),
                            ("disk", disk)):
            hits.add_metric(label + [tier], value)
        yield hits
        swaps = counter("jaxkv:num_swap_preemptions", "Of vllm:num_preemptions, sequences "
                        "swapped to the host tier (the others are recomputed).",
                        labels=["model_name"])
        swaps.add_metric(label, s["num_swap_preemptions"])
        yield swaps
        usage = gauge("jaxkv:kv_offload_usage_perc", "Fraction of the host tier's blocks in "
                      "use (1 = full).", labels=["model_name"])
        usage.add_metric(label, (s["kv_offload_blocks_prefix"] + s["kv_offload_blocks_swapped"])
                         / s["kv_offload_blocks_total"])
        yield usage


class ServerMetrics:
    """The server's registry: engine gauges/counters plus per-request observations.

    Args:
      model_name: the served model name (the ``model_name`` label).
      stats: returns ``EngineCore.stats()`` (read under the engine lock).
    """

    def __init__(self, model_name: str, stats: Callable[[], dict]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, stats))
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                                     **kw)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Generated tokens of finished requests.", **kw)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               labelnames=["model_name", "finished_reason"],
                               registry=self.registry)
        hist = dict(kw, buckets=_LATENCY_BUCKETS)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", **hist)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between a request's consecutive engine steps' tokens.", **hist)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", **hist)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Arrival to first scheduled.", **hist)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
                       self.e2e, self.queue):
            metric.labels(model_name)              # the series exist (at zero) from the start
        for reason in (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR):
            self.success.labels(model_name, reason)

    def observe_step(self, previous: RequestOutput | None, out: RequestOutput) -> None:
        """One new output of a request (after ``previous``, its last one seen, if any)."""
        m, label = out.metrics, self.model_name
        if previous is None or previous.metrics.first_token_time is None:
            if m.first_token_time is not None:
                self.ttft.labels(label).observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue.labels(label).observe(m.first_scheduled_time - m.arrival_time)
        elif m.last_token_time is not None and m.last_token_time > previous.metrics.last_token_time:
            self.itl.labels(label).observe(m.last_token_time - previous.metrics.last_token_time)

    def observe_finished(self, out: RequestOutput) -> None:
        """A finished request: its tokens, its finish reason (the first choice's, as vLLM
        counts requests, not choices) and its latency."""
        label = self.model_name
        self.prompt_tokens.labels(label).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(label).inc(sum(len(c.token_ids) for c in out.outputs))
        self.success.labels(label, out.outputs[0].finish_reason).inc()
        if out.metrics.e2e_latency is not None:
            self.e2e.labels(label).observe(out.metrics.e2e_latency)

    def observe_aborted(self) -> None:
        """A request the server aborted before it finished (its client went away)."""
        self.success.labels(self.model_name, FINISH_ABORT).inc()

    def exposition(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
