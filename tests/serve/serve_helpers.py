"""Test doubles and helpers for the server's tests.

- `FakeStream`: GenerationStream's interface (dspark_compile/runtime/scheduler.py) over a toy model:
  a request's tokens are a function of (prompt, seed) alone, committed 1..3 per step, so a test
  knows every request's exact output whatever it shares the batch with; stop ids and
  max_new_tokens end a request as the engine does (stop id included), rows are bounded, the
  counters have the real keys. For the pure unit tests of the app; the engine tests run the
  real stream. `fail_prompts`: prompts whose admission raises inside the "engine" (after
  validation), reported as GenerationStream does with isolate_failures: the request alone
  ends with an event carrying the exception.
- `train_tokenizer`: a byte-level BPE tokenizer (Hugging Face `tokenizers`) trained on a
  built-in text, written as tokenizer.json, for text in and out.
"""
from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import NamedTuple

TEXT = """The quick brown fox jumps over the lazy dog. A speculative decoder drafts a block of
tokens and the target verifies them in one step; the accepted prefix is committed and the
rest is drawn again. Compilers rewrite graphs, kernels move bytes, and servers stream text to
clients who may leave at any time. Caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c\u8a9e,
emoji \U0001F680 and other multi-byte characters split across byte-level tokens.
"""


def train_tokenizer(path, vocab_size: int = 512) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    path = Path(path)
    tok.save(str(path))
    return path


class StreamEvent(NamedTuple):
    request: int
    tokens: list
    finished: bool
    error: BaseException | None = None


def fake_tokens(prompt, seed: int, vocab: int, n: int) -> list[int]:
    rng = random.Random(hash((tuple(prompt), seed)) & 0xFFFFFFFF)
    return [rng.randrange(2, vocab) for _ in range(n)]


class FakeStream:
    def __init__(self, vocab: int = 512, max_rows: int = 3, block: int = 5, seed: int = 0):
        self.vocab, self.max_rows, self.block = vocab, max_rows, block
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: list[int] = []
        self._running: dict[int, dict] = {}
        self._cancels: set[int] = set()
        self._req: dict[int, dict] = {}
        self._rng = random.Random(seed)
        self.c = {"steps": 0, "greedy_steps": 0, "steps_per_bucket": {}, "row_steps": 0,
                  "draft_tokens": 0, "accepted_tokens": 0, "accepted_at": [0] * block,
                  "committed_tokens": 0}
        self.added: list[tuple[list[int], object]] = []
        self.step_hook = None       # called at the start of every step (tests: slow it down)
        self.fail_prompts: dict[tuple, Exception] = {}   # prompt -> raised at its admission
        self.isolate_failures = False

    def add(self, prompt, params) -> int:
        if not prompt:
            raise ValueError("prompt is empty")
        params.validate(self.vocab)
        with self._lock:
            rid = self._next
            self._next += 1
            self._req[rid] = {"params": params, "out": [], "prompt": tuple(prompt),
                              "all": fake_tokens(prompt, params.seed, self.vocab,
                                                 params.max_new_tokens)}
            self._waiting.append(rid)
            self.added.append((list(prompt), params))
        return rid

    def cancel(self, request: int) -> bool:
        with self._lock:
            if request in self._waiting or request in self._running:
                self._cancels.add(request)
                return True
            return False

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running or self._cancels)

    def step(self):
        if self.step_hook is not None:
            self.step_hook()
        events = []
        with self._lock:
            for rid in sorted(self._cancels):
                if rid in self._waiting:
                    self._waiting.remove(rid)
                self._running.pop(rid, None)
                events.append(StreamEvent(rid, [], True))
            self._cancels.clear()
            while self._waiting and len(self._running) < self.max_rows:
                rid = self._waiting.pop(0)
                err = self.fail_prompts.get(self._req[rid]["prompt"])
                if err is not None:
                    try:
                        raise err
                    except Exception as e:   # noqa: BLE001 -- the raise gives it a traceback
                        events.append(StreamEvent(rid, [], True, e))
                    continue
                self._running[rid] = self._req[rid]
            if not self._running:
                return events
            self.c["steps"] += 1
            b = 1 << (len(self._running) - 1).bit_length()
            self.c["steps_per_bucket"][b] = self.c["steps_per_bucket"].get(b, 0) + 1
            greedy = all(r["params"].temperature <= 0 for r in self._running.values())
            self.c["greedy_steps"] += int(greedy)
            for rid in sorted(self._running):
                r = self._running[rid]
                n = self._rng.randint(1, 3)
                self.c["row_steps"] += 1
                self.c["draft_tokens"] += self.block
                self.c["accepted_tokens"] += n - 1
                for k in range(n - 1):
                    self.c["accepted_at"][k] += 1
                new, done = [], False
                for t in r["all"][len(r["out"]):len(r["out"]) + n]:
                    new.append(t)
                    if t in r["params"].stop_ids:
                        done = True
                        break
                r["out"] += new
                self.c["committed_tokens"] += len(new)
                done = done or len(r["out"]) >= r["params"].max_new_tokens
                if done:
                    del self._running[rid]
                events.append(StreamEvent(rid, new, done))
        return events

    def counters(self) -> dict:
        with self._lock:
            c = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                 for k, v in self.c.items()}
            c["running"], c["waiting"] = len(self._running), len(self._waiting)
            return c

    def expected(self, prompt, params) -> list[int]:
        """What a request ends with (stop id included, as the engine does)."""
        out = []
        for t in fake_tokens(prompt, params.seed, self.vocab, params.max_new_tokens):
            out.append(t)
            if t in params.stop_ids:
                break
        return out


class FakeEngine:
    """What Server reads from an Engine, around a FakeStream."""

    class _Cfg:
        vocab_size, dspark_block_size, eos_token_id = 512, 5, 1

    class _Cache:
        max_rows, max_seq_len = 3, 160

    def __init__(self, engine_dir, max_rows: int = 3):
        self.dir = Path(engine_dir)
        self.cfg, self.cache = self._Cfg(), self._Cache()
        self.cache.max_rows = max_rows
        self.manifest = {"checksum": "0123456789abcdef0123"}
        self.fake = FakeStream(max_rows=max_rows)

    def open_stream(self):
        return self.fake


def start_stream(url: str, body: dict, chunks: int = 1):
    """POST a streaming completion over a raw socket and read until the response's headers
    and `chunks` SSE events have arrived (chunks=0: the headers only, sent once the request
    is queued in the engine); returns (the open socket, the token ids those events carried).
    Closing the socket is the client's disconnect."""
    import json
    import socket
    from urllib.parse import urlparse
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    got = b""

    def events() -> int:
        head, sep, rest = got.partition(b"\r\n\r\n")
        return rest.count(b"\n\n") if sep else -1

    while events() < chunks and b"[DONE]" not in got:
        more = s.recv(65536)
        if not more:
            break
        got += more
    ids = []
    for line in got.decode(errors="replace").splitlines():
        if line.startswith("data: {"):
            try:
                msg = json.loads(line[6:])
            except ValueError:          # an event cut by the read: not counted
                continue
            ids += [t for c in msg.get("choices", []) for t in c["token_ids"]]
    return s, ids
