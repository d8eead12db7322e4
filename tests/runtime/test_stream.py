"""Engine.stream / open_stream on the real engine (CPU, float64, the session's small engine:
buckets 1 and 2, five rows): what the stream delivers equals generate() and, for greedy rows,
the target decoding each prompt alone, with requests joining and cancelled mid-run and steps
launched ahead of the reads (overlap). The scheduling invariants at scale are
tests/runtime/test_stream_scheduler.py (a stand-in engine)."""
import random

import pytest

from dspark_compile.runtime.lossless import greedy_reference
from dspark_compile.models.request import SamplingParams
from dspark_compile.runtime.scheduler import StreamEvent


def _prompts(rng, V, lengths):
    return [[rng.randrange(V) for _ in range(n)] for n in lengths]


def _collect(events) -> dict:
    """{request: (tokens, finished)}, checking that nothing follows a request's end."""
    out = {}
    for e in events:
        toks, done = out.get(e.request, ([], False))
        assert not done, f"request {e.request}: an event after its end"
        out[e.request] = (toks + list(e.tokens), e.finished)
    return out


def _drain(s) -> list:
    events = []
    while s.has_work:
        step = s.step()
        assert len({e.request for e in step}) == len(step), "two events for one request"
        events += step
    return events


def test_stream_with_overlap_equals_serial_generate(small_loaded):
    """Greedy and sampled requests (fixed seeds) and one ended by a stop id: the overlapped
    stream's events, concatenated, are generate()'s tokens (serial, the CPU default), and its
    acceptance counts are generate()'s."""
    eng = small_loaded
    rng = random.Random(11)
    prompts = _prompts(rng, eng.cfg.vocab_size, [6, 11, 3])
    params = [SamplingParams(max_new_tokens=9),
              SamplingParams(max_new_tokens=8, temperature=0.9, top_k=7, seed=3),
              SamplingParams(max_new_tokens=12, temperature=1.1, top_p=0.9, seed=8,
                             verify="token")]
    ref = eng.generate(prompts, params)
    stop = ref.tokens[0][4]
    params[0] = SamplingParams(max_new_tokens=9, stop_ids=(stop,))
    want = ref.tokens[0][:ref.tokens[0].index(stop) + 1]
    s = eng.open_stream(overlap=True)
    launches = []
    eng.launch = lambda rows, key, launch=eng.launch: (launches.append(list(rows)),
                                                       launch(rows, key))[1]
    try:
        assert [s.add(p, sp) for p, sp in zip(prompts, params)] == [0, 1, 2]
        got = _collect(_drain(s))
    finally:
        s.close()
        del eng.launch
    assert got == {0: (want, True), 1: (ref.tokens[1], True), 2: (ref.tokens[2], True)}
    # request 0 (row 0, never reused: three requests, five rows) ran a step past its stop id,
    # launched before the stop was read; that step's tokens went to nobody
    assert sum(0 in rows for rows in launches) == s.result.by_method["greedy"].row_steps + 1
    # the sampled requests' acceptance is theirs alone: as in the serial run
    assert s.result.by_method["token"].accepted_at == ref.by_method["token"].accepted_at
    assert s.result.by_method["block"].accepted_at == ref.by_method["block"].accepted_at
    c = s.counters()
    assert c["committed_tokens"] == len(want) + len(ref.tokens[1]) + len(ref.tokens[2])
    assert c["row_steps"] == s.result.row_steps and c["running"] == c["waiting"] == 0
    # Engine.stream: the same events, indexed by prompt
    assert _collect(eng.stream(prompts[:1], params[:1], overlap=True)) == {0: got[0]}


def test_joins_and_cancels_keep_every_request_its_own(small_loaded, ref_model):
    """Three requests run; two more join after two steps (five rows: one of them waits); a
    running request and the waiting one are cancelled. Every greedy request's tokens equal the
    target decoding its prompt alone; the cancelled ones end with ([], True); every row is free
    at the end."""
    eng = small_loaded
    rng = random.Random(12)
    V = eng.cfg.vocab_size
    p = _prompts(rng, V, [5, 9, 4, 7, 3, 6])
    s = eng.open_stream(overlap=True)
    try:
        a = s.add(p[0], SamplingParams(max_new_tokens=10))
        c = s.add(p[1], SamplingParams(max_new_tokens=30, temperature=0.8, seed=1))
        b = s.add(p[2], SamplingParams(max_new_tokens=8))
        events = s.step() + s.step()
        d = s.add(p[3], SamplingParams(max_new_tokens=6))
        e = s.add(p[4], SamplingParams(max_new_tokens=5))
        x = s.add(p[5], SamplingParams(max_new_tokens=5))
        events += s.step()
        # x is waiting or prefilled, its first token not read yet: it cannot have ended
        assert s.cancel(c) and s.cancel(x)
        after = s.step()
        assert StreamEvent(c, [], True) in after and StreamEvent(x, [], True) in after
        events += after + _drain(s)
        got = _collect(events)
        assert sorted(s.free) == list(range(eng.cache.max_rows)) and not s.active
    finally:
        s.close()
    for rid, prompt, n in ((a, p[0], 10), (b, p[2], 8), (d, p[3], 6), (e, p[4], 5)):
        alone = greedy_reference(ref_model, prompt, n)[0]
        assert got[rid] == (alone, True), f"request {rid}"
    assert got[c][1] and len(got[c][0]) < 30
    assert got[x] == ([], True)
    assert not s.cancel(a), "an ended request cannot be cancelled"


def test_one_stream_per_engine_and_checked_options(small_loaded):
    eng = small_loaded
    s = eng.open_stream()
    try:
        with pytest.raises(RuntimeError, match="already open"):
            eng.open_stream()
        with pytest.raises(RuntimeError, match="already open"):
            eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="max_new_tokens 200 need.*max_seq_len=160"):
            s.add([1, 2, 3], SamplingParams(max_new_tokens=200))
        with pytest.raises(ValueError, match="stop_ids"):
            s.add([1, 2, 3], SamplingParams(stop_ids=(eng.cfg.vocab_size,)))
        assert not s.has_work and s.step() == []
    finally:
        s.close()
    eng.open_stream().close()            # closed: another may open
    with pytest.raises(ValueError, match="prefill_tokens"):
        eng.open_stream(prefill_tokens=0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.stream([[1], []], SamplingParams())
    assert eng._stream is None or eng._stream() is None or eng._stream().closed
