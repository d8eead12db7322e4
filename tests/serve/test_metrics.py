"""The server's metric primitives (dspark_compile/serve/metrics.py), parsed back with
prometheus_client's own parser."""
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark_compile.serve.metrics import ITL_BUCKETS, Hist, Metrics


def samples(metrics: Metrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(metrics.render().decode())
            for s in fam.samples}


def test_histogram_counts_a_delivery_once_per_token_and_bounds_are_inclusive():
    m = Metrics(block=5, max_queue=2)
    m.itl.observe(0.003, 3)              # 0.003 is a bound: counted at le=0.003
    m.itl.observe(0.2)
    m.itl.observe(99.0, 2)               # above every bound: only +Inf
    s = samples(m)
    b = lambda le: s[("dspark_inter_token_latency_seconds_bucket", (("le", le),))]  # noqa: E731
    assert b("0.002") == 0 and b("0.003") == 3 and b("0.25") == 4 and b("2.5") == 4
    assert b("+Inf") == 6
    assert s[("dspark_inter_token_latency_seconds_count", ())] == 6
    assert s[("dspark_inter_token_latency_seconds_sum", ())] == pytest.approx(
        0.009 + 0.2 + 198.0)
    assert len([k for k in s if k[0] == "dspark_inter_token_latency_seconds_bucket"]) == \
        len(ITL_BUCKETS) + 1


def test_tokens_per_second_is_the_rate_over_the_last_ten_seconds():
    m = Metrics(block=5, max_queue=0)
    assert m.tokens_per_second(now=0.0) == 0.0
    for t in range(0, 31):               # 30 s at 100 tokens/s, sampled each second
        m.engine_counters({"committed_tokens": 100 * t}, now=float(t))
    assert m.tokens_per_second(now=30.0) == pytest.approx(100.0)
    # idle since: the window's tokens over the window, decaying to 0 once it is empty
    assert m.tokens_per_second(now=35.0) == pytest.approx(500 / 10, rel=0.2)
    assert m.tokens_per_second(now=45.0) == 0.0


def test_engine_counters_before_any_step_expose_zeros():
    s = samples(Metrics(block=3, max_queue=7))
    assert s[("dspark_spec_decode_num_drafts_total", ())] == 0
    assert s[("dspark_spec_decode_mean_acceptance_length", ())] == 0
    assert s[("dspark_greedy_variant_share", ())] == 0
    assert s[("dspark_queue_capacity", ())] == 7
    for k in (1, 2, 3):
        assert s[("dspark_spec_decode_acceptance_per_position", (("position", str(k)),))] == 0
    assert s[("dspark_requests_total", (("outcome", "queue_full"),))] == 0


def test_hist_alone_is_a_collector():
    h = Hist("x_seconds", "doc", (1.0, 2.0))
    h.observe(1.5, 4)
    (fam,) = list(h.collect())
    got = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert got[("x_seconds_bucket", "1.0")] == 0 and got[("x_seconds_bucket", "2.0")] == 4
    assert got[("x_seconds_count", None)] == 4 and got[("x_seconds_sum", None)] == 6.0
