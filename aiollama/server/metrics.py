"""Prometheus metrics of one engine: gauges read from its statistics at scrape time, histograms of
time to first token, queue time, end-to-end and inter-token latency (observed by the server) and
step time (kept by the decode thread).

Names against llama-server's ``/metrics`` (which has counters and gauges only) and vLLM's
histograms: ``aiollama_tokens_in`` ~ ``llamacpp:prompt_tokens_total``, ``aiollama_tokens_out`` ~
``llamacpp:tokens_predicted_total``, ``aiollama_decode_steps`` ~ ``llamacpp:n_decode_total``,
``aiollama_active_conversations`` ~ ``llamacpp:requests_processing``, ``aiollama_queue_depth`` ~
``llamacpp:requests_deferred``, ``aiollama_kv_cells_used`` / ``aiollama_kv_cells_total`` ~
``llamacpp:kv_cache_usage_ratio``; ``aiollama_time_to_first_token_seconds``,
``aiollama_request_queue_time_seconds``, ``aiollama_e2e_request_latency_seconds`` and
``aiollama_inter_token_latency_seconds`` are vLLM's ``vllm:`` histograms of the same names.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from aiollama import Statistics

Labels = Callable[[], dict[str, str] | None]
Gauges = Callable[[], dict[str, tuple[str, float]]]


class EngineCollector(Collector):
    """The engine's gauges and counters at scrape time; ``settings``: what the engine was started
    with, as labels of ``aiollama_engine_info``; ``gauges``: the server's own (name: help, value)."""

    def __init__(self, statistics: Callable[[], Statistics | None], settings: Labels = lambda: None,
                 gauges: Gauges = dict) -> None:
        self._statistics, self._settings, self._gauges = statistics, settings, gauges

    def collect(self) -> Iterator[Metric]:
        for name, (help_text, value) in self._gauges().items():
            yield GaugeMetricFamily(f"aiollama_{name}", help_text, value=value)
        settings = self._settings()
        if settings is not None:
            info = GaugeMetricFamily("aiollama_engine_info", "What the engine was started with", labels=list(settings))
            info.add_metric(list(settings.values()), 1)
            yield info
        s = self._statistics()
        if s is None:
            return
        for name, help_text, value in [
            ("queue_depth", "Generations waiting for a sequence id", s.queued),
            ("active_conversations", "Conversations generating now", s.active),
            ("live_conversations", "Conversations open (generating or not)", s.live),
            ("kv_cells_used", "KV cache cells in use (conversations and the prefix cache)", s.kv_cells_used),
            ("kv_cells_cached", "KV cache cells held only by the prefix cache", s.kv_cells_cached),
            ("kv_cells_total", "KV cache cells in the context", s.kv_cells_total),
            ("seq_ids_used", "Sequence ids held", s.seq_ids_used),
            ("cache_entries", "Prefixes of closed conversations kept in the KV cache", s.cache_entries),
            ("host_parked", "Sequence states parked in host memory", s.parked),
            ("host_parked_bytes", "Bytes of sequence states parked in host memory", s.parked_bytes),
            ("checkpoints", "Checkpoints of recurrent states kept in host memory", s.checkpoints),
            ("checkpoint_bytes", "Bytes of checkpoints of recurrent states", s.checkpoint_bytes),
            ("disk_entries", "Sequence states of this model in the disk tier", s.disk_entries),
            ("disk_bytes", "Bytes of sequence states of this model in the disk tier", s.disk_bytes),
        ]:
            yield GaugeMetricFamily(f"aiollama_{name}", help_text, value=value)
        for name, help_text, value in [
            ("tokens_in", "Tokens evaluated (prompts and re-evaluation)", s.tokens_evaluated),
            ("tokens_out", "Tokens generated", s.tokens_generated),
            ("decode_steps", "Decode steps", s.decode_steps),
            ("discarded_tokens", "Rows decoded for streams that ended meanwhile (overlapped steps)",
             s.discarded_tokens),
            ("cache_hit_tokens", "Prompt tokens not evaluated: shared from the KV cache or restored",
             s.cache_hit_tokens),
            ("parks", "Sequence states copied out to host memory", s.parks),
            ("restores", "Sequence states put back from host memory", s.restores),
            ("checkpoints_used", "Recurrent states put back from a checkpoint", s.checkpoints_used),
            ("disk_loads", "Sequence states read back from the disk tier", s.disk_loads),
            ("evictions", "Idle holders that gave KV cells back", s.evictions),
            ("preemptions", "Running generations stopped to free KV cells", s.preemptions),
            ("spec_decode_draft_tokens", "Speculative draft tokens verified", s.drafted_tokens),
            ("spec_decode_accepted_tokens", "Speculative draft tokens the sampler took", s.accepted_tokens),
        ]:
            yield CounterMetricFamily(f"aiollama_{name}", help_text, value=value)
        # where the engine computes, as a labelled constant (Prometheus' "info" pattern)
        placed = GaugeMetricFamily("aiollama_device_info", "Where the weights and the KV cache are",
                                   labels=["weights", "kv_cache"])
        placed.add_metric([s.weights_device, s.kv_device], 1)
        yield placed
        if s.step_histogram:
            cumulative = list(itertools.accumulate(s.step_histogram))
            buckets = [(str(b), n) for b, n in zip(s.step_buckets, cumulative)]
            buckets.append(("+Inf", cumulative[-1]))
            yield HistogramMetricFamily("aiollama_step_seconds", "Time of one decode step",
                                        buckets=buckets, sum_value=s.step_seconds)


class Metrics:
    """The registry of one app (not the global one: several apps may live in one process)."""

    def __init__(self, statistics: Callable[[], Statistics | None], settings: Labels = lambda: None,
                 gauges: Gauges = dict) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(statistics, settings, gauges))
        self.time_to_first_token = Histogram(
            "aiollama_time_to_first_token_seconds", "From request to the first generated token",
            buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry)
        self.queue_time = Histogram(
            "aiollama_request_queue_time_seconds", "From request to the generation's admission into the batch",
            buckets=(0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=self.registry)
        self.e2e_latency = Histogram(
            "aiollama_e2e_request_latency_seconds", "From request to its last generated token",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300), registry=self.registry)
        self.inter_token_latency = Histogram(
            "aiollama_inter_token_latency_seconds", "Between two generated tokens of one choice, as delivered",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5), registry=self.registry)
        self.requests = Counter("aiollama_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
