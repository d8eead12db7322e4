"""GenerationStream's scheduling (dspark_compile/runtime/scheduler.py) over a stand-in engine whose step
is a few host ints per row: every invariant of the loop at scale in milliseconds. The real
engine's streams are tests/runtime/test_stream.py.

The stand-in keeps, per state row, what the device keeps (the request's key, tokens generated,
last position) and updates it at launch, as a step updates the state whatever the host knows.
A request's j-th token is tok(key, j) and a step commits g(key, count) of them, whatever shares
the batch: the expected output of every request is known in closed form. Every launch checks
the positions it writes against max_seq_len, the rows against the buckets, and that no row runs
a step before its prefill is complete.
"""
import random
import threading
from types import SimpleNamespace

import pytest
import torch

from dspark_compile.engine_dir.format import STEP, ProgramKey
from dspark_compile.models.generate import set_row_sampling
from dspark_compile.runtime.cuda_graphs import pack
from dspark_compile.models.request import SamplingParams
from dspark_compile.runtime.engine import Launched, StepTimes
from dspark_compile.runtime.scheduler import GenerationStream, StreamEvent

N, V = 5, 1000


def tok(key: int, j: int) -> int:
    return (key * 7919 + j * 104729) % V


def per_step(key: int, count: int) -> int:
    return 1 + (key * 31 + count * 17) % (N + 1)


def expected(prompt, sp: SamplingParams) -> list[int]:
    out = []
    for j in range(sp.max_new_tokens):
        out.append(tok(sum(prompt) * 131 + len(prompt), j))
        if out[-1] in sp.stop_ids:
            break
    return out


class FakeEngine:
    def __init__(self, max_rows=5, max_seq_len=96, buckets=(1, 2, 4), chunk=8):
        self.cfg = SimpleNamespace(dspark_block_size=N, vocab_size=V)
        self.cache = SimpleNamespace(max_rows=max_rows, max_seq_len=max_seq_len)
        self.buckets, self.chunk = list(buckets), chunk
        self.greedy = {ProgramKey(STEP, b, "greedy") for b in buckets}
        self.trash = max_rows
        R = max_rows + 1
        self.state = {"row.temperature": torch.zeros(R), "row.top_k": torch.zeros(R, dtype=torch.int64),
                      "row.top_p": torch.ones(R), "row.seed": torch.zeros(R, dtype=torch.int64),
                      "row.verify": torch.zeros(R, dtype=torch.int64),
                      "row.draft_logits": torch.zeros(R, N, 1)}
        self.rows = {}            # row -> {"key", "count", "last", "done_to"}
        self.launches = []        # (rows, bucket, greedy)
        self.prefill_log = []     # (row, calls)
        self.times = StepTimes()

    def bucket_for(self, n):
        return next(b for b in self.buckets if b >= n)

    def has(self, key):
        return key.kind == STEP and (key.variant == "full" or key in self.greedy)

    def set_row_sampling(self, row, params):
        set_row_sampling(self.state, row, params)

    def prefill_calls(self, prompt):
        c = self.chunk
        return [(s, min(c, len(prompt) - s), c) for s in range(0, len(prompt), c)]

    def launch_prefill(self, row, prompt, calls):
        st = self.rows.get(row)
        if calls[0][0] == 0 or st is None or st.get("prompt") is not prompt:
            assert calls[0][0] == 0, "a prompt's prefill resumed on a row that holds another"
            st = self.rows[row] = {"prompt": prompt, "done_to": 0}
        for start, n, _ in calls:
            assert start == st["done_to"], f"prefill calls out of order: {calls}"
            st["done_to"] = start + n
        self.prefill_log.append((row, list(calls)))
        if st["done_to"] < len(prompt):
            return Launched(torch.zeros(1, dtype=torch.int64))
        st.update(key=sum(prompt) * 131 + len(prompt), count=1, last=len(prompt) - 1)
        return Launched(torch.tensor([tok(st["key"], 0)]))

    def launch(self, rows, key):
        b, greedy = key.size, key.variant == "greedy"
        assert len(rows) <= b and b in self.buckets and len(set(rows)) == len(rows)
        assert self.has(key), key
        self.launches.append((list(rows), b, greedy))
        out = torch.full((len(rows), N + 2), -1, dtype=torch.int64)
        for i, r in enumerate(rows):
            st = self.rows[r]
            assert st["done_to"] == len(st["prompt"]), f"row {r} stepped before its prefill ended"
            top = st["last"] + N + 1
            assert top <= self.cache.max_seq_len - 1, (
                f"row {r}: a step writes position {top}, past max_seq_len "
                f"{self.cache.max_seq_len}")
            n = per_step(st["key"], st["count"])
            out[i, :n] = torch.tensor([tok(st["key"], st["count"] + k) for k in range(n)])
            out[i, N + 1] = n
            st["count"] += n
            st["last"] += n
        self.times.steps += 1
        return Launched(out, key=key)


def run(s: GenerationStream, limit=10_000):
    events = []
    for _ in range(limit):
        if not s.has_work:
            return events
        events.append(s.step())
    raise AssertionError("the stream did not finish")


def by_request(events):
    out = {}
    for step_events in events:
        ids = [e.request for e in step_events]
        assert len(ids) == len(set(ids)), "two events for one request in one step"
        for e in step_events:
            assert not out.get(e.request, ([], False))[1], f"request {e.request}: event after end"
            toks, _ = out.setdefault(e.request, ([], False))
            out[e.request] = (toks + e.tokens, e.finished)
    return out


def random_requests(rng, n, max_seq_len=96):
    reqs = []
    for _ in range(n):
        L = rng.randint(1, 30)
        new = rng.randint(1, max_seq_len - L - N - 2)
        prompt = [rng.randrange(V) for _ in range(L)]
        stops = (tok(sum(prompt) * 131 + L, rng.randrange(new)),) if rng.random() < 0.3 else ()
        reqs.append((prompt, SamplingParams(max_new_tokens=new, stop_ids=stops,
                                            temperature=rng.choice((0.0, 0.8)))))
    return reqs


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_every_request_gets_its_own_tokens_and_every_row_is_freed(overlap):
    """Forty requests through five rows: joins, waiting, reuse, stop ids, requests sized to the
    state's max_seq_len (a step launched ahead on them would write past it: the stand-in
    asserts), requests ended by their first token."""
    rng = random.Random(0)
    eng = FakeEngine()
    s = GenerationStream(eng, overlap, prefill_tokens=8)
    reqs = random_requests(rng, 40)
    reqs.append(([3] * 10, SamplingParams(max_new_tokens=96 - 10 - N - 2)))   # the limit
    reqs.append(([4], SamplingParams(max_new_tokens=1)))
    ids = [s.add(p, sp) for p, sp in reqs]
    assert ids == list(range(len(reqs)))
    got = by_request(run(s))
    for i, (p, sp) in enumerate(reqs):
        assert got[i] == (expected(p, sp), True), f"request {i}"
    assert sorted(s.free) == list(range(eng.cache.max_rows)) and not s.active
    c = s.counters()
    assert c["running"] == c["waiting"] == 0 and c["free_rows"] == eng.cache.max_rows
    assert c["committed_tokens"] == sum(len(expected(p, sp)) for p, sp in reqs)
    assert c["steps"] == sum(c["steps_per_bucket"].values())
    assert c["draft_tokens"] == N * c["row_steps"]
    assert c["accepted_tokens"] == sum(c["accepted_at"])
    assert s.result.row_steps == c["row_steps"]
    if overlap:
        assert eng.times.steps >= c["steps"]
    else:
        assert eng.times.steps == c["steps"] and eng.times.discarded == 0


def test_a_step_launched_ahead_commits_nothing_to_an_ended_request():
    """One request ends at a stop id it commits in the middle of a step; the step after it was
    launched before that was read (overlap), so its row ran one more step: the request's tokens
    stop at the stop id, and no event follows its end."""
    eng = FakeEngine(buckets=(1,))
    prompt = [9, 9, 9]
    key = sum(prompt) * 131 + 3
    out = [tok(key, j) for j in range(40)]
    stop = out[7]
    assert stop not in out[:7]
    s = GenerationStream(eng, True, prefill_tokens=8)
    rid = s.add(prompt, SamplingParams(max_new_tokens=40, stop_ids=(stop,)))
    events = run(s)
    assert by_request(events)[rid] == (out[:8], True)
    launched_on_it = sum(1 for rows, _, _ in eng.launches if rows == [0])
    credited = s.result.row_steps
    assert launched_on_it == credited + 1, "no step ran past the end: the test shows nothing"
    assert eng.times.discarded == 1
    # the serial loop runs exactly the credited steps
    eng2 = FakeEngine(buckets=(1,))
    s2 = GenerationStream(eng2, False, prefill_tokens=8)
    s2.add(prompt, SamplingParams(max_new_tokens=40, stop_ids=(stop,)))
    assert by_request(run(s2))[0] == (out[:8], True)
    assert len(eng2.launches) == s2.result.row_steps == credited


def test_a_row_certain_to_have_ended_is_not_launched_again():
    """max_new_tokens = 1: the first token ends it, so no step is launched on its row even with
    overlap (its output is in flight when the next step is launched)."""
    eng = FakeEngine()
    s = GenerationStream(eng, True, prefill_tokens=8)
    s.add([1, 2], SamplingParams(max_new_tokens=1))
    run(s)
    assert eng.launches == []


def test_cancel_frees_the_row_before_the_next_step():
    eng = FakeEngine(max_rows=2)
    s = GenerationStream(eng, True, prefill_tokens=8)
    a = s.add([1] * 3, SamplingParams(max_new_tokens=60))
    b = s.add([2] * 3, SamplingParams(max_new_tokens=60))
    w = s.add([3] * 3, SamplingParams(max_new_tokens=4))      # waits: two rows
    late = s.add([4] * 3, SamplingParams(max_new_tokens=4))
    s.step()
    s.step()
    assert s.counters()["waiting"] == 2
    assert s.cancel(a) and s.cancel(late)
    assert not s.cancel(a) and not s.cancel(999)
    row_a = next(r.row for r in s.active.values() if r.id == a)
    events = s.step()
    assert StreamEvent(a, [], True) in events and StreamEvent(late, [], True) in events
    # a's row went to the waiting request in this very step: its prefill ran on it
    assert eng.prefill_log[-1][0] == row_a
    assert all(a not in [r.id for r in rec.requests if r.status == "running"]
               for rec in s.records)
    rest = by_request(run(s))
    assert rest[w] == (expected([3] * 3, SamplingParams(max_new_tokens=4)), True)
    assert rest[b][1] and a not in rest and late not in rest
    assert sorted(s.free) == [0, 1] and not s.has_work
    assert not s.cancel(w), "an ended request cannot be cancelled"


def test_a_long_prompt_does_not_stall_running_requests():
    """A 40-token prompt (five chunk calls of 8) joins while a request decodes: with a budget of
    8 prefill tokens per step, every step() runs one chunk call and the running request commits
    tokens in each of them; the joining request's tokens are its own."""
    eng = FakeEngine(max_seq_len=200, chunk=8)
    s = GenerationStream(eng, True, prefill_tokens=8)
    run_id = s.add([5, 6], SamplingParams(max_new_tokens=150))
    s.step()
    s.step()
    long = [7] * 40
    j = s.add(long, SamplingParams(max_new_tokens=5))
    steps = [s.step() for _ in range(5)]
    for ev in steps:
        assert any(e.request == run_id and e.tokens for e in ev), "the running request stalled"
    calls = [c for row, c in eng.prefill_log[1:]]
    assert calls == [[(k * 8, 8, 8)] for k in range(5)]
    rest = by_request(steps + run(s))
    assert rest[j] == (expected(long, SamplingParams(max_new_tokens=5)), True)


def test_with_nothing_decoding_every_waiting_prompt_prefills_at_once():
    eng = FakeEngine(chunk=8)
    s = GenerationStream(eng, True, prefill_tokens=8)
    for k in range(3):
        s.add([k + 1] * 20, SamplingParams(max_new_tokens=3))
    s.step()
    assert len(eng.prefill_log) == 3 and [r for r, _ in eng.prefill_log] == [0, 1, 2]
    assert eng.launches and eng.launches[0][0] == [0, 1, 2]


def test_requests_added_from_another_thread_all_complete():
    eng = FakeEngine()
    s = GenerationStream(eng, True, prefill_tokens=8)
    rng = random.Random(4)
    reqs = random_requests(rng, 30)
    ids = []

    def producer():
        for p, sp in reqs:
            ids.append(s.add(p, sp))
    t = threading.Thread(target=producer)
    t.start()
    events = []
    while t.is_alive() or s.has_work:
        events.append(s.step())
    t.join()
    got = by_request(events)
    assert sorted(ids) == list(range(30))
    for i, (p, sp) in zip(ids, reqs):
        assert got[i] == (expected(p, sp), True), f"request {i}"


def test_a_closed_stream_takes_nothing():
    s = GenerationStream(FakeEngine(), True, prefill_tokens=8)
    s.add([1], SamplingParams(max_new_tokens=5))
    s.step()
    s.close()
    assert not s.has_work and sorted(s.free) == list(range(5))
    with pytest.raises(RuntimeError, match="closed"):
        s.add([1], SamplingParams())
    with pytest.raises(RuntimeError, match="closed"):
        s.step()


@pytest.mark.parametrize("prompt,params,field", [
    ([], SamplingParams(), "prompt is empty"),
    ("abc", SamplingParams(), "prompt must be a list"),
    ([1, 2.5], SamplingParams(), "prompt must be a list of integer"),
    ([1, V], SamplingParams(), r"prompt: token ids \[1000\] outside"),
    ([1], {"max_new_tokens": 3}, "params must be a SamplingParams"),
    ([1], SamplingParams(max_new_tokens=0), "max_new_tokens must be >= 1"),
    ([1], SamplingParams(max_new_tokens="5"), "max_new_tokens must be an int"),
    ([1], SamplingParams(temperature=-1.0), "temperature"),
    ([1], SamplingParams(temperature=float("nan")), "temperature"),
    ([1], SamplingParams(top_p=0.0), "top_p"),
    ([1], SamplingParams(top_k=-2), "top_k"),
    ([1], SamplingParams(seed=1 << 70), "seed"),
    ([1], SamplingParams(stop_ids=(V + 3,)), "stop_ids"),
    ([1], SamplingParams(stop_ids="x"), "stop_ids"),
    ([1], SamplingParams(verify="fast"), "verify"),
    ([1] * 50, SamplingParams(max_new_tokens=40), "max_new_tokens 40 need.*max_seq_len=96"),
])
def test_add_names_the_bad_field(prompt, params, field):
    s = GenerationStream(FakeEngine(), True, prefill_tokens=8)
    with pytest.raises(ValueError, match=field):
        s.add(prompt, params)
    assert not s.has_work


def test_add_takes_integer_and_real_types_and_copies_the_params():
    import numpy as np
    eng = FakeEngine()
    s = GenerationStream(eng, True, prefill_tokens=8)
    sp = SamplingParams(max_new_tokens=np.int64(3), temperature=np.float32(0.0), stop_ids=[7])
    rid = s.add(np.array([1, 2]), sp)
    sp.max_new_tokens = 50                      # the request keeps what add() saw
    got = by_request(run(s))
    assert got[rid] == (expected([1, 2], SamplingParams(max_new_tokens=3, stop_ids=(7,))), True)
    with pytest.raises(ValueError, match="max_new_tokens must be an int"):
        s.add([1], SamplingParams(max_new_tokens=True))
