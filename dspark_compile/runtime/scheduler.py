"""Who runs next: the requests of a GenerationStream, their state rows, chunked prefill, and the
loop that launches step n + 1 before it reads step n.

    add(prompt, params)  validated at once -> a request id; joins at the next step()
    cancel(id)           its row is free before the next step() does anything else
    step():  cancels -> admission (free rows to waiting requests; their prefill calls, within
             a token budget while other requests decode) -> launch the decode step of every
             running row (groups of at most the largest bucket) -> read the outputs launched
             by the previous step() (overlap) or by this one (serial) -> events

Why step n + 1 can be launched before step n's tokens are read: a step's only host input is
its rows; the tokens it verifies, its drafts and its positions are in the state, which step n
updates on the device, and the launches are ordered on one stream. What the host learns late
is only which requests ended at step n; their rows ran step n + 1 for nothing:

- its tokens are dropped, by request: every output is matched to the request that held the
  row when it was launched, and a request that has ended takes no more tokens;
- its writes stay in the row, beyond what the request committed: the row's next prefill
  rewrites what a request reads, as after any request (a row is reused without clearing);
- its positions must fit the state: a step writes last + 1 .. last + N + 1. The host knows
  each row's last position up to the steps in flight (each commits at most N + 1), and a row
  whose bound could pass max_seq_len is not launched ahead: the outputs in flight are read
  first (a serial step). With the engine's max_seq_len well above a request's positions this
  never happens; a request sized to the limit has its last step or two run serially;
- a row that is certain to have ended (every step in flight commits at least one token: its
  tokens read plus the outputs in flight reach max_new_tokens) is not launched at all.

The stream's results equal the serial loop's (overlap off) token for token: greedy rows do not
depend on what shares the batch, and a sampled row's noise is keyed by (seed, position). Only
the schedule differs: with overlap a row freed at step n is admitted one step later.

Prefill: the engine's prefill programs are one row per call (models/prefill_chunk.py), so
waiting prompts are not batched into one forward; their chunk calls are queued back to back
with no host read between them (the first token comes back with the next step's outputs), and
while requests decode, one step() runs at most `prefill_tokens` tokens of chunks (at least one
call), so a long prompt is spread over several steps instead of stalling the running rows.
An engine without prefill programs prefills a whole prompt per call (the eager reference).

Without speculation (Engine.open_stream(speculative=False)) the same loop launches the buckets'
target-only programs: each step commits exactly one token per row and writes one position, and
no acceptance is counted.

Logprobs (runtime/logprobs.py): a request added with `logprobs=k` gets, on each event, the
target's logprob of each token it commits and the top k; a step whose group has such a row
runs its program's logprobs variant (one more output, read with the same copy), every other
step the program as built. `prompt_logprobs=k` (echo) runs the eager reference over the prompt
on the request's row at admission, before its prefill (synchronously: the host waits for it);
with `decode=False` the request ends there, committing nothing.

Which program a step runs is decided here alone (program_for), for the stream and for
Engine.run_step. What the stream needs of an engine (Engine; tests/runtime/test_stream_scheduler.py
fakes it): `cfg` (block size, vocabulary), `cache` (rows, positions), `buckets`, `bucket_for`,
`has(ProgramKey)`, `launch(rows, ProgramKey)`, `prefill_calls`, `launch_prefill`,
`set_row_sampling(row, params)` and the `times` counters; for logprobs requests also
`logprobs_refusal()`, `has_logprobs(ProgramKey)`, `prompt_logprobs(row, prompt, k)` and the
`logprobs` keyword of `launch` / `launch_prefill`.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from dspark_compile.engine_dir.format import STEP, TARGET, ProgramKey
from dspark_compile.models.generate import GenerationResult, append_committed
from dspark_compile.models.request import SamplingParams, validate_request
from dspark_compile.runtime.cuda_graphs import unpack
from dspark_compile.runtime.logprobs import MAX_LOGPROBS, Entries


def program_for(engine, bucket: int, all_greedy: bool, speculative: bool = True,
                logprobs: bool = False) -> ProgramKey:
    """The program a step of `bucket` runs: the target-only step without speculation; the
    step's greedy variant when every live row is greedy and the engine has it (a sampled row
    must never run it: its draft sampler takes the argmax); else the step. `logprobs`: of the
    programs with a logprobs variant (Engine.launch(..., logprobs=True) runs it)."""
    if not speculative:
        return ProgramKey(TARGET, bucket)
    greedy = ProgramKey(STEP, bucket, "greedy")
    has = engine.has_logprobs if logprobs else engine.has
    return greedy if all_greedy and has(greedy) else ProgramKey(STEP, bucket)


class StreamEvent(NamedTuple):
    request: int        # Engine.stream: the prompt's index; GenerationStream: the id add() returned
    tokens: list[int]   # token ids newly committed to this request by this step (stop ids
                        # included, as generate() includes them); [] only for a cancelled request
    finished: bool      # the request ended (stop id, max_new_tokens, cancelled, failed)
    error: BaseException | None = None   # it failed inside the engine (isolate_failures)
    # a logprobs request's: one (logprob, ((id, logprob), ... top k)) per token of `tokens`
    # (runtime/logprobs.py Entries: decoded when first read, by the consumer)
    logprobs: Entries | None = None
    # a prompt_logprobs request's first event: one entry per prompt token, None for the first
    prompt_logprobs: list | None = None


WAITING, PREFILL, RUNNING, DONE = "waiting", "prefill", "running", "done"


@dataclass(eq=False)
class _Request:
    id: int
    prompt: list
    params: SamplingParams
    status: str = WAITING
    logprobs: int | None = None          # top logprobs per committed token (None: none)
    prompt_logprobs: int | None = None   # top logprobs per prompt token (echo; None: none)
    decode: bool = True                  # False: the prompt's logprobs only, no token
    row: int = -1
    calls: list = field(default_factory=list)    # prefill calls not launched yet
    tokens: list = field(default_factory=list)   # committed (delivered) tokens
    read: int = 0          # tokens its read outputs committed (before the stop / max cut)
    inflight: int = 0      # its launched outputs not read yet (first token, steps)
    steps_inflight: int = 0
    last: int = -1         # its last committed position as read (prompt end - 1 + accepted)


@dataclass(eq=False)
class _Record:
    """One launch whose outputs are not read yet."""
    launched: object       # runtime.Launched
    kind: str              # "step" or "prefill"
    requests: list         # the request of each batch row, as launched
    call: int              # the step() call that launched it


def _counters(N: int) -> dict:
    return {"steps": 0, "greedy_steps": 0, "steps_per_bucket": {}, "row_steps": 0,
            "draft_tokens": 0, "accepted_tokens": 0, "accepted_at": [0] * N,
            "committed_tokens": 0}


class GenerationStream:
    """Continuous batching over one engine's state rows (Engine.open_stream; one per engine at
    a time). add() and cancel() may be called from other threads than step(). `result`: the
    acceptance counts (per verification method) and the scheduling iterations that ran a step,
    as GenerationResult holds them (Engine.generate returns it with the tokens filled in).

    `isolate_failures` (off: an exception leaves step(), as generate() wants; the server turns
    it on): an exception of the engine's calls for some requests ends those requests alone,
    each with StreamEvent(id, [], True, error=the exception), and frees their rows; the others
    go on. Which requests a failure ends:
      - admission (the row's sampling settings, the prompt's prefill calls) or the read of its
        first token: that request;
      - a decode step's launch or the read of its outputs: every request of that launch (one
        batch writes all its rows: none of their states is known good any more);
      - a device error (a CUDA error is sticky: every later call fails too) is not one
        request's: it leaves step()."""

    isolate_failures = False

    def __init__(self, engine, overlap: bool, prefill_tokens: int, speculative: bool = True):
        self.engine, self.overlap, self.prefill_tokens = engine, overlap, prefill_tokens
        self.speculative = speculative
        self.N = engine.cfg.dspark_block_size
        # positions one step writes per row, and the most tokens it commits
        self.span = self.N + 1 if speculative else 1
        self.max_seq_len = engine.cache.max_seq_len
        self.free = list(range(engine.cache.max_rows))
        self.waiting: deque[_Request] = deque()
        self.active: dict[int, _Request] = {}      # admitted (prefill or running), by id
        self.records: deque[_Record] = deque()
        self.result = GenerationResult(accepted_at=[0] * self.N)   # acceptance, steps
        self.closed = False
        self._lock = threading.Lock()
        self._incoming: list[_Request] = []
        self._cancels: list[int] = []
        self._live: set[int] = set()               # added, not ended (cancel's and has_work's)
        self._next_id = 0
        self._call = 0
        self._spent = 0
        self._counts = _counters(self.N)

    # ------------------------------------------------------------------ public
    def add(self, prompt, params: SamplingParams, logprobs: int | None = None,
            prompt_logprobs: int | None = None, decode: bool = True) -> int:
        """Validate the request (ValueError naming the field) and queue it; returns its id.
        `logprobs` / `prompt_logprobs`: the top logprobs (0..MAX_LOGPROBS) to return with each
        committed / prompt token (the module docstring); `decode=False` (with
        prompt_logprobs): the prompt's logprobs alone."""
        prompt, params = self._validated(prompt, params)
        self._check_logprobs(logprobs, prompt_logprobs, decode)
        with self._lock:
            if self.closed:
                raise RuntimeError("add() on a closed GenerationStream")
            rid = self._next_id
            self._next_id += 1
            self._incoming.append(_Request(rid, prompt, params, logprobs=logprobs,
                                           prompt_logprobs=prompt_logprobs,
                                           decode=bool(decode)))
            self._live.add(rid)
        return rid

    def cancel(self, request: int) -> bool:
        """End request `request`: its row is freed at the start of the next step(), which
        yields StreamEvent(request, [], True); False for an unknown or ended id."""
        with self._lock:
            if request not in self._live:
                return False
            self._live.discard(request)
            self._cancels.append(request)
            return True

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._live) or bool(self._cancels)

    def counters(self) -> dict:
        with self._lock:
            out = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                   for k, v in self._counts.items()}
            out["running"] = len(self.active)
            out["waiting"] = len(self.waiting) + len(self._incoming)
            out["free_rows"] = len(self.free)
        return out

    def step(self) -> list[StreamEvent]:
        """One scheduling iteration (the module docstring); [] when there is no work."""
        import torch
        if self.closed:
            raise RuntimeError("step() on a closed GenerationStream")
        self._call += 1
        self._spent = 0                    # prefill tokens launched by this step()
        events: dict[int, list] = {}       # request -> [tokens, finished], in order
        with torch.no_grad():
            self._apply_incoming(events)
            if self.overlap:
                self._admit(events)
                self._launch(events)
                self._read(events, keep_call=self._call)
            else:
                while self._admit(events):
                    self._read(events)     # first tokens: a request ended by it frees its row
                self._launch(events)
                self._read(events)
            if not self.active and not self.waiting:
                self._read(events)         # steps launched ahead on rows that all ended
        return [StreamEvent(r, *e) for r, e in events.items()]

    def close(self) -> None:
        """Cancel every request and free every row; the stream takes no more requests."""
        with self._lock:
            self.closed = True
            self._live.clear()
            self._incoming.clear()
            self._cancels.clear()
        for r in list(self.active.values()):
            self._end(r)
        self.waiting.clear()
        self.records.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ validation
    def _validated(self, prompt, params) -> tuple[list, SamplingParams]:
        """models/request.py's rules against this engine's vocabulary and rows."""
        return validate_request(prompt, params, self.engine.cfg.vocab_size, self.max_seq_len,
                                self.N, f"the engine holds max_seq_len={self.max_seq_len}")

    def _check_logprobs(self, logprobs, prompt_logprobs, decode) -> None:
        for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if k is None:
                continue
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, "
                                 f"got {k!r}")
        if logprobs is not None and self.speculative:
            why = self.engine.logprobs_refusal()
            if why is not None:
                raise ValueError(f"logprobs: {why}")
        if logprobs is not None and not self.speculative:
            raise ValueError("logprobs: only a speculative stream returns them (the target-only "
                             "programs have no logprobs variant)")
        if not decode and prompt_logprobs is None:
            raise ValueError("decode=False needs prompt_logprobs (a request must return "
                             "something)")

    # ------------------------------------------------------------------ the iteration
    def _event(self, events: dict, r: _Request, tokens: list, finished: bool,
               logprobs: tuple | None = None) -> None:
        # [tokens, finished, error, logprobs, prompt_logprobs]: StreamEvent's fields
        e = events.setdefault(r.id, [[], False, None, None, None])
        e[0].extend(tokens)
        e[1] = e[1] or finished
        if logprobs is not None:
            if e[3] is None:
                e[3] = Entries()
            e[3].add(*logprobs)

    def _apply_incoming(self, events: dict) -> None:
        with self._lock:
            new, self._incoming = self._incoming, []
            cancels, self._cancels = self._cancels, []
        self.waiting.extend(new)
        for rid in cancels:
            r = self.active.get(rid) or next((w for w in self.waiting if w.id == rid), None)
            if r is None:
                continue             # it ended in the meantime (its event said so)
            if r.status == WAITING:
                self.waiting.remove(r)
                r.status = DONE
            else:
                self._end(r)
            self._event(events, r, [], True)

    def _end(self, r: _Request) -> None:
        """The request is over: its row is free (launches in flight on it are dropped when
        read: they name this request, which takes no more tokens)."""
        if r.status in (PREFILL, RUNNING):
            self.free.append(r.row)
            del self.active[r.id]
        r.status = DONE
        with self._lock:
            self._live.discard(r.id)

    def _failed(self, requests: list, exc: Exception, events: dict) -> None:
        """The engine raised `exc` for `requests`: end them (rows freed) with the exception
        on their last event, or re-raise where failures are not isolated."""
        if not self.isolate_failures or _device_error(exc):
            raise exc
        for r in requests:
            if r.status != DONE:
                self._end(r)
                self._event(events, r, [], True)
                events[r.id][2] = exc

    def _decoding(self) -> bool:
        return any(r.status == RUNNING for r in self.active.values())

    def _admit(self, events: dict) -> bool:
        """Launch prefill calls: the partly prefilled request first, then waiting requests into
        free rows, within the token budget while other requests decode (unbounded when none
        does: nobody waits behind a prompt then). True when anything was launched."""
        eng = self.engine
        budget = self.prefill_tokens if self._decoding() else math.inf
        launched = False
        while self._spent < budget:
            r = next((a for a in self.active.values() if a.status == PREFILL), None)
            if r is None:
                if not (self.waiting and self.free):
                    break
                r = self.waiting.popleft()
                r.row, r.status = self.free.pop(0), PREFILL
                self.active[r.id] = r
                try:
                    r.calls, r.last = eng.prefill_calls(r.prompt), len(r.prompt) - 1
                    eng.set_row_sampling(r.row, r.params)
                    if r.prompt_logprobs is not None:
                        # the eager pass over the prompt (its tokens count in the budget)
                        self._spent += len(r.prompt)
                        self._event(events, r, [], not r.decode)
                        events[r.id][4] = eng.prompt_logprobs(r.row, r.prompt,
                                                              r.prompt_logprobs)
                except Exception as e:  # noqa: BLE001 -- this request's alone (_failed)
                    self._failed([r], e, events)
                    continue
                if not r.decode:
                    self._end(r)
                    continue
            calls = []
            # the step's first call always runs (progress), later ones within the budget
            while r.calls and (self._spent == 0 or self._spent + r.calls[0][2] <= budget):
                calls.append(r.calls.pop(0))
                self._spent += calls[-1][2]
            if not calls:
                break
            try:
                out = (eng.launch_prefill(r.row, r.prompt, calls, logprobs=True)
                       if r.logprobs is not None else eng.launch_prefill(r.row, r.prompt, calls))
            except Exception as e:  # noqa: BLE001 -- this request's alone (_failed)
                self._failed([r], e, events)
                continue
            launched = True
            if not r.calls:
                r.status, r.inflight = RUNNING, r.inflight + 1
                self.records.append(_Record(out, "prefill", [r], self._call))
        return launched

    def _launchable(self) -> list[_Request]:
        """Running requests that may need another step: not certain to have ended by the
        outputs in flight (each commits at least one token)."""
        return sorted((r for r in self.active.values() if r.status == RUNNING
                       and r.read + r.inflight < r.params.max_new_tokens), key=lambda r: r.row)

    def _fits(self, r: _Request) -> bool:
        """The step's writes fit the row even if every step in flight committed `span`."""
        top = r.last + (r.steps_inflight + 1) * self.span
        return top <= self.max_seq_len - 1

    def _launch(self, events: dict) -> None:
        eng = self.engine
        rows = self._launchable()
        if rows and not all(self._fits(r) for r in rows):
            self._read(events)           # a serial step: positions exactly known again
            rows = self._launchable()
        big = eng.buckets[-1]
        for start in range(0, len(rows), big):
            group = rows[start:start + big]
            b = eng.bucket_for(len(group))
            rows_ = [r.row for r in group]
            lp = any(r.logprobs is not None for r in group)
            try:
                key = program_for(eng, b, all(r.params.method == "greedy" for r in group),
                                  self.speculative, lp)
                out = eng.launch(rows_, key, logprobs=True) if lp else eng.launch(rows_, key)
            except Exception as e:  # noqa: BLE001 -- the group's requests (_failed)
                self._failed(group, e, events)
                continue
            for r in group:
                r.inflight += 1
                r.steps_inflight += 1
            self.records.append(_Record(out, "step", group, self._call))

    def _read(self, events: dict, keep_call: int | None = None) -> None:
        """Read the records in launch order (all, or those launched before call `keep_call`):
        commit their tokens to the requests still running, end those that finish."""
        counted = set()
        while self.records and self.records[0].call != keep_call:
            rec = self.records.popleft()
            try:
                host = rec.launched.wait()
            except Exception as e:  # noqa: BLE001 -- the launch's requests (_failed)
                for r in rec.requests:
                    r.inflight -= 1
                    r.steps_inflight -= rec.kind == "step"
                self._failed(rec.requests, e, events)
                continue
            if rec.kind == "prefill":
                r = rec.requests[0]
                r.inflight -= 1
                if r.status == RUNNING:
                    r.read += 1
                    lps = self._logprobs(rec.launched, 1, r, 0, 1)
                    self._commit(r, [int(host[0])], events, lps)
                continue
            tokens, num = (t.tolist() for t in unpack(host))
            live = 0
            for i, r in enumerate(rec.requests):
                r.inflight -= 1
                r.steps_inflight -= 1
                if r.status != RUNNING:
                    continue             # ended while this step was in flight: not its tokens
                n = num[i]
                live += 1
                r.read += n
                r.last += n
                if self.speculative:
                    self.result.record(n, r.params.method)
                    self._count_row(n)
                lps = (None if r.logprobs is None
                       else self._logprobs(rec.launched, self.N + 1, r, i, n))
                self._commit(r, tokens[i][:n], events, lps)
            if not live:
                self.engine.times.discarded += 1
                continue
            with self._lock:
                c = self._counts
                c["steps"] += 1
                c["greedy_steps"] += int(rec.launched.greedy)
                b = rec.launched.bucket
                c["steps_per_bucket"][b] = c["steps_per_bucket"].get(b, 0) + 1
            counted.add(rec.call)
        self.result.steps += len(counted)

    def _count_row(self, n: int) -> None:
        with self._lock:
            c = self._counts
            c["row_steps"] += 1
            c["draft_tokens"] += self.N
            c["accepted_tokens"] += n - 1
            for k in range(n - 1):
                c["accepted_at"][k] += 1

    def _logprobs(self, launched, n1: int, r: _Request, i: int, n: int) -> tuple | None:
        """Row i's logprobs of its first n positions (of n1 in the payload), for a request that
        asks: (its payload row, n1, n, k), decoded by whoever reads the event (Entries)."""
        if r.logprobs is None or launched.payload is None:
            return None
        return launched.payload[i:i + 1], n1, n, r.logprobs

    def _commit(self, r: _Request, new: list, events: dict, logprobs: tuple | None = None) -> None:
        before = len(r.tokens)
        done = append_committed(r.tokens, new, r.params)
        added = r.tokens[before:]
        with self._lock:
            self._counts["committed_tokens"] += len(added)
        if done:
            self._end(r)
        if logprobs is not None:      # the tokens a stop id or max_new_tokens cut off: none
            row, n1, n, k = logprobs
            logprobs = row, n1, min(n, len(added)), k
        self._event(events, r, added, done, logprobs)


def _device_error(exc: BaseException) -> bool:
    """A fault of the device, not of one request: CUDA reports an illegal access or a failed
    launch as a sticky error (every later call on the context fails too)."""
    import torch
    accel = getattr(torch, "AcceleratorError", None)
    return ((accel is not None and isinstance(exc, accel))
            or "CUDA error" in str(exc) or "CUDA driver error" in str(exc))
