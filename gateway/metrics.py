"""The gateway's Prometheus series: traffic by tenant/model/status, latencies, engine gauges and
counters.

The engine's series are read from each EngineClient when /metrics is scraped, so they are never
stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.engine_client import EngineClient
from gateway.prometheus import BoundHistogram, Counter, Gauge, Histogram, Metric, render

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class LatencyMetrics:
    """One model's latency histograms, bound once per call."""

    time_to_first_token: BoundHistogram
    time_per_output_token: BoundHistogram
    e2e_request_latency: BoundHistogram


class GatewayMetrics:
    """Every series the gateway exports; `render(engines)` is the /metrics body."""

    def __init__(self) -> None:
        self.requests = Counter("switchboard_requests_total",
                                "API requests by tenant, model and HTTP status.",
                                ("tenant", "model", "status"))
        self.prompt_tokens = Counter("switchboard_prompt_tokens_total",
                                     "Prompt tokens processed, by tenant and the model that "
                                     "processed them.",
                                     ("tenant", "model"))
        self.generation_tokens = Counter("switchboard_generation_tokens_total",
                                         "Tokens generated, by tenant and model.", ("tenant", "model"))
        self.time_to_first_token = Histogram(
            "switchboard_time_to_first_token_seconds",
            "Time from the request's arrival to its first output token.", _TTFT_BUCKETS, ("model",))
        self.time_per_output_token = Histogram(
            "switchboard_time_per_output_token_seconds",
            "Time between consecutive output tokens of a request.", _TPOT_BUCKETS, ("model",))
        self.e2e_request_latency = Histogram(
            "switchboard_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token.", _E2E_BUCKETS, ("model",))
        self.num_waiting = Gauge("switchboard_num_requests_waiting",
                                 "Requests queued in the engine, waiting to be scheduled.", ("model",))
        self.num_running = Gauge("switchboard_num_requests_running",
                                 "Requests in the engine's running batch.", ("model",))
        self.kv_usage = Gauge("switchboard_kv_cache_usage_ratio",
                              "Fraction of the engine's KV-cache blocks in use.", ("model",))
        self.kv_blocks_used = Gauge("switchboard_kv_cache_blocks_used",
                                    "KV-cache blocks in use.", ("model",))
        # NOTE: not named _total, which Prometheus keeps for counters.
        self.kv_blocks_capacity = Gauge("switchboard_kv_cache_blocks_capacity",
                                        "KV-cache blocks in the engine's pool.", ("model",))
        self.prefix_cache_hit_rate = Gauge("switchboard_prefix_cache_hit_rate",
                                           "Share of queried prompt tokens served from the prefix "
                                           "cache.", ("model",))
        # NOTE: the engine's own running totals, read at scrape time: they only go up, so they
        # are counters, though set rather than incremented here.
        self.prefix_cache_queried = Counter("switchboard_prefix_cache_queried_tokens_total",
                                            "Prompt tokens looked up in the prefix cache.", ("model",))
        self.prefix_cache_hits = Counter("switchboard_prefix_cache_hit_tokens_total",
                                         "Prompt tokens found in the prefix cache.", ("model",))
        self.num_preemptions = Counter("switchboard_num_preemptions_total",
                                       "Requests preempted by the engine since it started.", ("model",))
        self.adapter_hits = Counter("switchboard_adapter_cache_hits_total",
                                    "Adapter requests whose adapter was already in a device slot.",
                                    ("model",))
        self.adapter_misses = Counter("switchboard_adapter_cache_misses_total",
                                      "Adapter requests whose adapter had to be paged in.", ("model",))
        self.adapter_evictions = Counter("switchboard_adapter_cache_evictions_total",
                                         "Device slots taken from an idle adapter.", ("model",))
        self.adapter_disk_loads = Counter("switchboard_adapter_disk_loads_total",
                                          "Adapters read from storage, validated and packed into "
                                          "host memory.", ("model",))
        self.adapters_resident = Gauge("switchboard_adapters_resident",
                                       "Adapters in device slots now.", ("model",))
        self.routed = Counter("switchboard_routed_requests_total",
                              "Requests sent through a route, by route, the model that answered "
                              "and whether it escalated.", ("route", "model", "escalated"))
        self.route_attempts = Counter("switchboard_route_tier_calls_total",
                                      "Tier calls made by routes (kept, escalated past, or cut "
                                      "short by the client), by route and model.", ("route", "model"))
        self.spend = Counter("switchboard_spend_usd_total",
                             "Spend charged to tenants, by tenant and the model that ran (a "
                             "route's escalated tiers under their own).",
                             ("tenant", "model"))
        # The series read from the engines when scraped, and the models they were read of.
        self._engine_series: list[Counter | Gauge] = [
            self.num_waiting, self.num_running, self.kv_usage, self.kv_blocks_used,
            self.kv_blocks_capacity, self.prefix_cache_hit_rate, self.prefix_cache_queried,
            self.prefix_cache_hits, self.num_preemptions,
            self.adapter_hits, self.adapter_misses, self.adapter_evictions,
            self.adapter_disk_loads, self.adapters_resident]
        self._engines_read: set[str] = set()

    def latency(self, model: str) -> LatencyMetrics:
        return LatencyMetrics(self.time_to_first_token.labels(model=model),
                              self.time_per_output_token.labels(model=model),
                              self.e2e_request_latency.labels(model=model))

    def count_tokens(self, tenant: str, model: str, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt, tenant=tenant, model=model)
        self.generation_tokens.inc(generated, tenant=tenant, model=model)

    def count_route(self, route: str, answered_by: str, escalated: bool,
                    tiers_run: list[str]) -> None:
        self.routed.inc(1, route=route, model=answered_by, escalated=str(escalated).lower())
        self.count_tier_calls(route, tiers_run)

    def count_tier_calls(self, route: str, tiers_run: list[str]) -> None:
        """Tier calls of a route, also those of a call no tier answered (the client left while a
        tier was judged): they ran and were billed."""
        for model in tiers_run:
            self.route_attempts.inc(1, route=route, model=model)

    def render(self, engines: Mapping[str, EngineClient]) -> str:
        # A model no longer served (its workers gone past their TTL) has no engine to sum: its
        # series go, rather than keep their last values for good.
        for model in self._engines_read - engines.keys():
            for series in self._engine_series:
                series.forget(model=model)
        self._engines_read = set(engines)
        for model, engine in engines.items():
            self._read_engine(model, engine)
        return render(self._all())

    def _read_engine(self, model: str, engine: EngineClient) -> None:
        stats = engine.stats()
        self.num_waiting.set(stats.num_waiting, model=model)
        self.num_running.set(stats.num_running, model=model)
        self.kv_usage.set(stats.kv_blocks_used / max(1, stats.kv_blocks_total), model=model)
        self.kv_blocks_used.set(stats.kv_blocks_used, model=model)
        self.kv_blocks_capacity.set(stats.kv_blocks_total, model=model)
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate, model=model)
        self.prefix_cache_queried.set_total(stats.prefix_cache_queried_tokens, model=model)
        self.prefix_cache_hits.set_total(stats.prefix_cache_hit_tokens, model=model)
        self.num_preemptions.set_total(stats.num_preemptions, model=model)
        self.adapter_hits.set_total(stats.adapter_hits, model=model)
        self.adapter_misses.set_total(stats.adapter_misses, model=model)
        self.adapter_evictions.set_total(stats.adapter_evictions, model=model)
        self.adapter_disk_loads.set_total(stats.adapter_disk_loads, model=model)
        self.adapters_resident.set(stats.adapters_resident, model=model)

    def _all(self) -> list[Metric]:
        return [m for m in vars(self).values() if isinstance(m, Metric)]
