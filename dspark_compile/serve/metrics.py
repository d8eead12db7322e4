"""/metrics: the server's Prometheus registry.

Names follow what operators of vLLM and SGLang already watch (their speculative-decoding
counters: drafts, draft tokens, accepted tokens, accepted tokens per draft position), with a
`dspark_` prefix:

    dspark_requests_total{outcome}          stop | length | cancelled | queue_full | invalid | error
    dspark_requests_running / _waiting      state rows in use / requests waiting for one
                                            (the queue depth)
    dspark_requests_in_flight               admitted, not finished (running + waiting)
    dspark_queue_capacity                   --max-queue
    dspark_steps_total{bucket}              engine steps per batch bucket
    dspark_greedy_variant_steps_total       of which ran the bucket's greedy variant
    dspark_greedy_variant_share             greedy_variant_steps / steps
    dspark_spec_decode_num_drafts_total     drafts verified (one per live row per step)
    dspark_spec_decode_num_draft_tokens_total
    dspark_spec_decode_num_accepted_tokens_total
    dspark_spec_decode_num_accepted_tokens_per_pos_total{position}   1-based draft position
    dspark_spec_decode_acceptance_per_position{position}            accepted_at[k] / drafts
    dspark_spec_decode_mean_acceptance_length                       1 + accepted / drafts
    dspark_prompt_tokens_total / dspark_generation_tokens_total
    dspark_generation_tokens_per_second     committed tokens per second over the last 10 s
    dspark_engine_busy_seconds_total        wall time in GenerationStream.step() (utilisation)
    dspark_time_to_first_token_seconds      histogram: request arrival -> first token
    dspark_inter_token_latency_seconds      histogram, one observation per token: the gap
                                            since the request's previous tokens / tokens committed
    dspark_request_latency_seconds          histogram: arrival -> last token
    dspark_engine_up                        1 while the engine thread runs, 0 once it failed

The same numbers under vLLM's names too (a `model_name` label; _VllmCollector):
vllm:num_requests_running / _waiting, vllm:spec_decode_num_drafts / _draft_tokens /
_accepted_tokens (/ _accepted_tokens_per_pos, positions from 0 as vLLM counts them),
vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:request_success_total
{finished_reason: stop | length | abort}, vllm:time_to_first_token_seconds,
vllm:inter_token_latency_seconds and vllm:time_per_output_token_seconds (the same
inter-token observations), vllm:e2e_request_latency_seconds.

The engine's counters (GenerationStream.counters()) are read by the engine thread after each
step and exposed from that snapshot at scrape time, so a scrape never touches the stream.
"""
from __future__ import annotations

import bisect
import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OUTCOMES = ("stop", "length", "cancelled", "queue_full", "invalid", "error")
RATE_WINDOW_S = 10.0
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25,
               0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self, block: int, max_queue: int, model_name: str = ""):
        self.block, self.max_queue, self.model_name = block, max_queue, model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("dspark_requests", "Requests by outcome", ["outcome"],
                                registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.prompt_tokens = Counter("dspark_prompt_tokens", "Prompt tokens of admitted "
                                     "requests", registry=r)
        self.in_flight = Gauge("dspark_requests_in_flight", "Requests admitted and not "
                               "finished (running + waiting)", registry=r)
        self.ttft = Hist("dspark_time_to_first_token_seconds", "Request arrival to its first "
                         "token", TTFT_BUCKETS)
        self.itl = Hist("dspark_inter_token_latency_seconds", "Per token: the gap since the "
                        "request's previous tokens over the tokens that arrived together",
                        ITL_BUCKETS)
        self.e2e = Hist("dspark_request_latency_seconds", "Request arrival to its last token",
                        E2E_BUCKETS)
        for h in (self.ttft, self.itl, self.e2e):
            r.register(h)
        self._lock = threading.Lock()
        self._snapshot: dict = {}
        self._samples: collections.deque = collections.deque()   # (time, committed tokens)
        self.down = False
        r.register(_EngineCollector(self))
        r.register(_VllmCollector(self))

    # ---- written by the engine thread
    def engine_counters(self, snapshot: dict, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._snapshot = snapshot
            s = self._samples
            committed = int(snapshot.get("committed_tokens", 0))
            if not s or now - s[-1][0] >= 0.1 or committed != s[-1][1]:
                s.append((now, committed))
            while len(s) > 2 and now - s[1][0] > RATE_WINDOW_S:
                s.popleft()

    def engine_down(self) -> None:
        """The engine thread failed: nothing runs or waits any more (every request in flight
        was answered 503), whatever the last snapshot held."""
        with self._lock:
            self.down = True
            self._snapshot = {**self._snapshot, "running": 0, "waiting": 0}

    # ---- written by the HTTP handlers
    def outcome(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            s = list(self._samples)
        if not s:
            return 0.0
        last_t, last_c = s[-1]
        # the oldest sample within the window (the one just before it if none is inside)
        start = next(((t, c) for t, c in s if now - t <= RATE_WINDOW_S), s[-1])
        span = now - start[0]
        return (last_c - start[1]) / span if span > 0 else 0.0

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._snapshot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Hist:
    """A Prometheus histogram whose observe() takes a count: the tokens a delivery brought
    share its gap, one bisect for all of them (prometheus_client's Histogram observes one
    value per call, under a lock: 64 rows x 3 tokens a step would be 192 calls on the event
    loop per step). Observed and scraped on the event loop's thread only."""

    def __init__(self, name: str, doc: str, buckets: tuple):
        self.name, self.doc, self.buckets = name, doc, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)      # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += n   # le is inclusive
        self.sum += value * n
        self.count += n

    def describe(self):
        return []

    def collect(self):
        yield HistogramMetricFamily(self.name, self.doc, buckets=self.cumulative(),
                                    sum_value=self.sum)

    def cumulative(self) -> list:
        acc, out = 0, []
        for bound, c in zip(self.buckets + (float("inf"),), self.counts):
            acc += c
            out.append((_le(bound), acc))
        return out


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class _EngineCollector:
    """The engine's counters, from the last snapshot the engine thread stored."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        c = self.m.snapshot()
        block = self.m.block
        steps, greedy = int(c.get("steps", 0)), int(c.get("greedy_steps", 0))
        per_bucket = CounterMetricFamily("dspark_steps", "Engine steps per batch bucket",
                                         labels=["bucket"])
        for b, n in sorted((c.get("steps_per_bucket") or {}).items(), key=lambda kv: int(kv[0])):
            per_bucket.add_metric([str(b)], int(n))
        yield per_bucket
        yield CounterMetricFamily("dspark_greedy_variant_steps", "Steps that ran the bucket's "
                                  "greedy variant (every live row greedy)", value=greedy)
        yield GaugeMetricFamily("dspark_greedy_variant_share", "Greedy-variant steps / steps",
                                value=greedy / steps if steps else 0.0)
        drafts = int(c.get("row_steps", 0))
        accepted = int(c.get("accepted_tokens", 0))
        yield CounterMetricFamily("dspark_spec_decode_num_drafts", "Drafts verified (one per "
                                  "live row per step)", value=drafts)
        yield CounterMetricFamily("dspark_spec_decode_num_draft_tokens", "Draft tokens "
                                  "proposed", value=int(c.get("draft_tokens", 0)))
        yield CounterMetricFamily("dspark_spec_decode_num_accepted_tokens", "Draft tokens "
                                  "accepted", value=accepted)
        at = list(c.get("accepted_at") or [0] * block)
        per_pos = CounterMetricFamily("dspark_spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts whose token at this 1-based position was "
                                      "accepted", labels=["position"])
        rate = GaugeMetricFamily("dspark_spec_decode_acceptance_per_position", "Fraction of "
                                 "drafts that accepted the draft token at this position",
                                 labels=["position"])
        for k, n in enumerate(at):
            per_pos.add_metric([str(k + 1)], int(n))
            rate.add_metric([str(k + 1)], n / drafts if drafts else 0.0)
        yield per_pos
        yield rate
        yield GaugeMetricFamily("dspark_spec_decode_mean_acceptance_length", "Tokens committed "
                                "per draft: 1 + accepted / drafts",
                                value=1.0 + accepted / drafts if drafts else 0.0)
        yield CounterMetricFamily("dspark_generation_tokens", "Tokens committed",
                                  value=int(c.get("committed_tokens", 0)))
        yield GaugeMetricFamily("dspark_generation_tokens_per_second", "Tokens committed per "
                                f"second over the last {RATE_WINDOW_S:g} s",
                                value=self.m.tokens_per_second())
        yield CounterMetricFamily("dspark_engine_busy_seconds", "Wall time the engine thread "
                                  "spent in step() (busy / elapsed: the engine's utilisation)",
                                  value=float(c.get("busy_s", 0.0)))
        yield GaugeMetricFamily("dspark_requests_running", "Requests holding a state row",
                                value=int(c.get("running", 0)))
        yield GaugeMetricFamily("dspark_requests_waiting", "Requests waiting for a state row "
                                "(queue depth)", value=int(c.get("waiting", 0)))
        yield GaugeMetricFamily("dspark_engine_up", "1 while the engine thread runs, 0 once "
                                "it failed (/health answers 503)", value=0 if self.m.down else 1)
        yield GaugeMetricFamily("dspark_queue_capacity", "Requests that may wait for a state "
                                "row (--max-queue)", value=self.m.max_queue)


# vLLM's finished_reason label of vllm:request_success_total, from this server's outcomes
VLLM_FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort"}


class _VllmCollector:
    """The same numbers under vLLM's names (`vllm:` prefix, a `model_name` label), so
    dashboards and benchmark reports built on vLLM's metrics read this server unchanged.
    vllm:time_per_output_token_seconds holds the inter-token observations, as
    vllm:inter_token_latency_seconds does (this server times the gap between deliveries)."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        m, c = self.m, self.m.snapshot()
        label = [m.model_name]

        def fam(kind, name, doc, value, extra=()):
            f = kind(name, doc, labels=["model_name", *(k for k, _ in extra)])
            f.add_metric(label + [v for _, v in extra], value)
            return f

        yield fam(GaugeMetricFamily, "vllm:num_requests_running", "Requests holding a state "
                  "row", int(c.get("running", 0)))
        yield fam(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting for a "
                  "state row", int(c.get("waiting", 0)))
        for name, key, doc in (("drafts", "row_steps", "Drafts verified"),
                               ("draft_tokens", "draft_tokens", "Draft tokens proposed"),
                               ("accepted_tokens", "accepted_tokens", "Draft tokens accepted")):
            yield fam(CounterMetricFamily, f"vllm:spec_decode_num_{name}", doc,
                      int(c.get(key, 0)))
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens at this 0-based position",
                                      labels=["model_name", "position"])
        for k, n in enumerate(c.get("accepted_at") or [0] * m.block):
            per_pos.add_metric(label + [str(k)], int(n))       # vLLM counts positions from 0
        yield per_pos
        yield fam(CounterMetricFamily, "vllm:prompt_tokens", "Prompt tokens of admitted "
                  "requests", _value(m.prompt_tokens))
        yield fam(CounterMetricFamily, "vllm:generation_tokens", "Tokens committed",
                  int(c.get("committed_tokens", 0)))
        success = CounterMetricFamily("vllm:request_success", "Requests finished, by reason",
                                      labels=["model_name", "finished_reason"])
        by_outcome = {s.labels["outcome"]: s.value for f in m.requests.collect()
                      for s in f.samples if s.name.endswith("_total")}
        for outcome, reason in VLLM_FINISHED.items():
            success.add_metric(label + [reason], by_outcome.get(outcome, 0.0))
        yield success
        for name, h in (("time_to_first_token_seconds", m.ttft),
                        ("inter_token_latency_seconds", m.itl),
                        ("time_per_output_token_seconds", m.itl),
                        ("e2e_request_latency_seconds", m.e2e)):
            f = HistogramMetricFamily(f"vllm:{name}", h.doc, labels=["model_name"])
            f.add_metric(label, h.cumulative(), h.sum)
            yield f


def _value(counter) -> float:
    return next(s.value for f in counter.collect() for s in f.samples
                if s.name.endswith("_total"))
