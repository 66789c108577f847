"""Prometheus metrics, named like vLLM's with the prefix ``hitchllm:``.

Updated from the engine thread after every loop iteration (``observe``), read by ``/metrics``.
Each server gets its own ``CollectorRegistry`` so several engines in one process (tests) do
not collide.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hitchllm.engine.llm_engine import EngineStats, LLMEngine
from hitchllm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class MetricsSource(Protocol):
    """What ``/metrics`` serves: ``ServerMetrics`` of one engine, or the merged metrics of
    data-parallel replicas."""

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""


@dataclass
class _RequestTiming:
    last_time: float
    num_tokens: int


class ServerMetrics:
    """The server's metric families and the bookkeeping that feeds them."""

    def __init__(self, model_name: str, max_loras: int | None = None) -> None:
        """``max_loras``: the engine's ``max_loras`` when it serves LoRA adapters (adds the
        LoRA metrics), else None."""
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"hitchllm:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"hitchllm:{name}", doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"hitchllm:{name}", doc, labels, buckets=_LATENCY_BUCKETS,
                             registry=self.registry)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests started.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Requests preempted (recompute or swap).")
        # Swap preemption (--preemption-mode swap / auto).
        self.swap_outs = counter("num_swap_outs", "Preempted requests swapped to host memory.")
        self.swap_ins = counter("num_swap_ins", "Swapped-out requests swapped back in.")
        self.host_blocks = gauge("host_kv_cache_blocks_used",
                                 "Host-pool KV blocks (per worker) held by swapped-out requests.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # Speculative decoding; acceptance rate = accepted / draft tokens, mean accepted
        # length per step = 1 + accepted / drafts, draft tokens per step = draft tokens / drafts.
        self.spec_drafts = counter("spec_decode_num_drafts",
                                   "Draft verifications (one per request and step with drafts).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.prompt_tokens_computed = counter(
            "prompt_tokens_computed",
            "Prompt tokens computed (not served by the prefix cache or a producer's KV).")
        # Disaggregated serving (a KV connector): transfers, their bytes (this server's
        # tensor-parallel rank 0's share) and seconds (a load: from the start of the wait
        # until the KV is here), and consumer requests that computed their prompt instead.
        kv = [counter(f"kv_transfer_{name}", doc) for name, doc in (
            ("saves", "KV saves done (producer)."),
            ("save_bytes", "KV bytes saved (producer)."),
            ("save_seconds", "Seconds from a save's start until its KV left (producer)."),
            ("loads", "KV loads done (consumer)."),
            ("load_bytes", "KV bytes loaded (consumer)."),
            ("load_seconds", "Seconds from a load's start until its KV arrived (consumer)."),
            ("failed_loads", "KV loads that failed (consumer)."),
            ("load_fallbacks", "Requests that computed their prompt: their KV never came."),
        )]
        self.request_success = counter("request_success", "Requests finished, by reason.",
                                       ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish.")
        self._model = model_name
        # Create every label child now so each metric is exported (as 0) from the start.
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens,
                       self.generation_tokens, self.preemptions, self.swap_outs, self.swap_ins,
                       self.host_blocks, self.prefix_queries,
                       self.prefix_hits, self.spec_drafts, self.spec_draft_tokens,
                       self.spec_accepted, self.ttft, self.itl, self.e2e,
                       self.prompt_tokens_computed, *kv):
            metric.labels(model_name)
        self._totals_of = [self.preemptions, self.prefix_queries, self.prefix_hits,
                           self.spec_drafts, self.spec_draft_tokens, self.spec_accepted,
                           self.prompt_tokens_computed, self.swap_outs, self.swap_ins, *kv]
        # The per-request series, looked up once (``labels`` takes a lock and builds a key;
        # these are updated for every request on every step).
        self._prompt_tokens = self.prompt_tokens.labels(model_name)
        self._generation_tokens = self.generation_tokens.labels(model_name)
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self._e2e = self.e2e.labels(model_name)
        self._timing: dict[str, _RequestTiming] = {}
        self._last_totals: tuple[float, ...] = (0,) * len(self._totals_of)
        self._lora: _LoRAMetrics | None = None
        if max_loras is not None:
            self._lora = _LoRAMetrics(self.registry, model_name, max_loras, counter)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, engine: LLMEngine, outputs: list[RequestOutput], now: float) -> None:
        """Fold one engine-loop iteration in (called from the engine thread)."""
        m = self._model
        stats = engine.stats()
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.host_blocks.labels(m).set(stats.host_blocks_used)
        kv = stats.kv_transfer
        totals = (stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits,
                  stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                  stats.spec_decode_num_accepted_tokens, stats.num_prompt_tokens_computed,
                  stats.num_swap_outs, stats.num_swap_ins,
                  kv.num_saves, kv.bytes_saved, kv.save_seconds, kv.num_loads, kv.bytes_loaded,
                  kv.load_seconds, kv.num_failed_loads, stats.kv_load_fallbacks)
        for metric, new, old in zip(self._totals_of, totals, self._last_totals, strict=True):
            if new > old:
                metric.labels(m).inc(new - old)
        self._last_totals = totals
        if self._lora is not None:
            self._lora.observe(stats)
        # Per step, not per request: the engine thread pays for every call here, and in a
        # decode step most requests share one gap since their last token.
        gaps: dict[float, int] = {}
        generated = 0
        for out in outputs:
            generated += self._observe_request(out, now, gaps)
        if generated:
            self._generation_tokens.inc(generated)
        for gap, count in gaps.items():
            _observe_many(self._itl, gap, count)

    def _observe_request(self, out: RequestOutput, now: float, gaps: dict[float, int]) -> int:
        """Fold one request's output in; returns its new tokens, and counts the inter-token
        gaps they make in ``gaps`` (gap -> number of tokens)."""
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        timing = self._timing.get(out.request_id)
        if timing is None:
            self._prompt_tokens.inc(len(out.prompt_token_ids))
            first = out.metrics.get("first_token_time")
            if first is not None and num_tokens:
                self._ttft.observe(first - out.metrics["arrival_time"])
            timing = _RequestTiming(now, 0)
            self._timing[out.request_id] = timing
        elif num_tokens > timing.num_tokens:
            new = num_tokens - timing.num_tokens
            gap = (now - timing.last_time) / new
            gaps[gap] = gaps.get(gap, 0) + new
        new_tokens = max(0, num_tokens - timing.num_tokens)
        if new_tokens:
            timing.num_tokens = num_tokens
            timing.last_time = now
        if out.finished:
            self._e2e.observe(now - out.metrics["arrival_time"])
            reason = out.outputs[0].finish_reason if out.outputs else "abort"
            self.request_success.labels(self._model, reason or "abort").inc()
            del self._timing[out.request_id]
        return new_tokens


def _observe_many(histogram: Histogram, value: float, count: int) -> None:
    """``count`` observations of ``value``: one bucket update instead of ``count`` calls of
    ``observe`` (each walks the buckets in Python) when the client library's histogram has
    the layout it has had since 0.4 (sorted ``_upper_bounds`` ending in +Inf, one
    ``_buckets`` value each, ``_sum``); else ``observe``, ``count`` times."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if count == 1 or bounds is None or buckets is None or total is None:
        for _ in range(count):
            histogram.observe(value)
        return
    buckets[bisect.bisect_left(bounds, value)].inc(count)
    total.inc(value * count)


class _LoRAMetrics:
    """LoRA adapters: vLLM's ``lora_requests_info`` (one series whose labels name the running
    and waiting adapters, comma-separated and sorted, and ``max_lora``; its value is the time
    of the last update) and totals of adapter loads, evictions and device activations."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_loras: int,
                 counter: Callable[[str, str], Counter]) -> None:
        self.info = Gauge("hitchllm:lora_requests_info",
                          "Running and waiting LoRA adapters (label values, comma-separated).",
                          ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                          registry=registry)
        self.loads = counter("lora_adapter_loads",
                             "LoRA adapters read from disk into host memory.")
        self.evictions = counter("lora_adapter_evictions",
                                 "LoRA adapters evicted from host memory (max_cpu_loras).")
        self.activations = counter("lora_adapter_activations",
                                   "LoRA adapters copied into a device slot (max_loras).")
        self._model = model_name
        self._max_loras = str(max_loras)
        self._labels: tuple[str, str] | None = None
        self._last = (0, 0, 0)
        for metric in (self.loads, self.evictions, self.activations):
            metric.labels(model_name)
        self._set_info((), ())

    def _set_info(self, running: tuple[str, ...], waiting: tuple[str, ...]) -> None:
        labels = (",".join(running), ",".join(waiting))
        if labels != self._labels:
            self.info.clear()  # one series: the adapters now, not every set ever seen
            self.info.labels(*labels, self._max_loras).set(time.time())
            self._labels = labels

    def observe(self, stats: EngineStats) -> None:
        self._set_info(stats.running_lora_adapters, stats.waiting_lora_adapters)
        totals = (stats.lora.num_loads, stats.lora.num_evictions, stats.lora.num_activations)
        for metric, new, old in zip((self.loads, self.evictions, self.activations), totals,
                                    self._last, strict=True):
            if new > old:
                metric.labels(self._model).inc(new - old)
        self._last = totals
