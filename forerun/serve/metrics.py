"""Prometheus metrics of the server, in its own registry (several servers per process in tests).

Acceptance rate and mean accepted length are ratios of counters, so they are exported
both ways: the counters (for rate() over a window) and gauges over the server's lifetime.
Per position i (1-based), forerun_position_accepted_total / forerun_position_drafted_total
is the share of drafts reaching position i whose token i was accepted.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STEP_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("forerun_requests", "Requests finished, by outcome", ["outcome"], registry=r)
        self.rejected = Counter("forerun_requests_rejected", "Requests refused before the engine, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("forerun_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated = Counter("forerun_generated_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("forerun_drafted_tokens", "Draft tokens scored by the verifier", registry=r)
        self.accepted = Counter("forerun_accepted_tokens", "Draft tokens accepted", registry=r)
        self.steps = Counter("forerun_steps", "Engine steps (one verifier forward per sampling group)", registry=r)
        self.pos_drafted = Counter("forerun_position_drafted", "Drafts reaching position i", ["position"], registry=r)
        self.pos_accepted = Counter("forerun_position_accepted", "Drafts accepted at position i", ["position"], registry=r)
        self.queue_depth = Gauge("forerun_queue_depth", "Requests waiting for a cache row", registry=r)
        self.batch_size = Gauge("forerun_batch_size", "Sequences in the last step", registry=r)
        self.kv_blocks_used = Gauge("forerun_kv_blocks_used", "KV blocks held by running sequences", registry=r)
        self.kv_blocks_total = Gauge("forerun_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.preemptions = Counter("forerun_preemptions", "Sequences that gave their KV blocks back to wait for room", registry=r)
        self.acceptance_rate = Gauge("forerun_acceptance_rate", "accepted / drafted since start", registry=r)
        self.mean_accepted_length = Gauge("forerun_mean_accepted_length", "Tokens per row per step since start (tau)", registry=r)
        self.step_time = Histogram("forerun_step_seconds", "Wall time of one scheduler step", buckets=STEP_BUCKETS, registry=r)
        self.prefill_time = Histogram("forerun_prefill_seconds", "Wall time of one admission prefill", buckets=STEP_BUCKETS, registry=r)
        self.prefix_queried = Counter("forerun_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache (all but each prompt's last)", registry=r)
        self.prefix_hit = Counter("forerun_prefix_cache_hit_tokens", "Prompt tokens whose K/V came from the prefix cache", registry=r)
        self.prefix_evicted = Counter("forerun_prefix_cache_evicted_tokens", "Cached tokens dropped to make room", registry=r)
        self._prefix_seen = (0, 0, 0)
        self.latency = Histogram("forerun_request_seconds", "Admission to last token", buckets=STEP_BUCKETS + (10.0, 30.0, 60.0), registry=r)
        self._row_steps = 0  # sum over steps of the batch size
        self._emitted = 0

    def on_prefill(self, tokens: int, seconds: float) -> None:
        self.prompt_tokens.inc(tokens)
        self.prefill_time.observe(seconds)

    def on_step(self, batch: int, seconds: float, drafted: int, accepted: int) -> None:
        self.steps.inc()
        self.batch_size.set(batch)
        self.step_time.observe(seconds)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        self._row_steps += batch
        self._emitted += accepted + batch  # each row emits its accepted drafts + one token
        d = self.drafted._value.get()
        self.acceptance_rate.set(self.accepted._value.get() / d if d else 0.0)
        self.mean_accepted_length.set(self._emitted / self._row_steps)

    def on_preempt(self) -> None:
        self.preemptions.inc()

    def on_finish(self, live, last) -> None:
        outcome = "error" if last.error else last.finish_reason or "unknown"
        self.requests.labels(outcome).inc()
        stats = last.stats
        self.generated.inc(last.completion_tokens)
        self.latency.observe(stats.wall_time)
        for i, (d, a) in enumerate(zip(getattr(stats, "drafted_at", []) or [], stats.accepted_at)):
            self.pos_drafted.labels(str(i + 1)).inc(d)
            self.pos_accepted.labels(str(i + 1)).inc(a)

    def render(self, scheduler) -> bytes:
        self.queue_depth.set(scheduler.queue_depth)
        self.kv_blocks_used.set(scheduler.blocks.used)
        self.kv_blocks_total.set(scheduler.blocks.num_blocks)
        if scheduler.prefix is not None:  # the pool's running totals, as counters
            st = scheduler.prefix.stats
            now = (st.queried, st.hit, st.evicted)
            for counter, new, old in zip((self.prefix_queried, self.prefix_hit, self.prefix_evicted), now, self._prefix_seen):
                counter.inc(new - old)
            self._prefix_seen = now
        return generate_latest(self.registry)
