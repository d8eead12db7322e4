"""Text out of committed token ids, a step at a time.

- :class:`Detokenizer`: incremental detokenization. Decoding each new token alone is wrong
  twice over: a multi-byte character split over byte-level tokens decodes to U+FFFD until its
  last byte arrives, and decoders that strip a leading space (SentencePiece's metaspace) lose
  the space between words. So each delta is the difference of two decodes that start at the
  same earlier token (the window `tokens[prefix:]` minus `tokens[prefix:read]`, as Hugging
  Face TGI and vLLM do), and a trailing U+FFFD run is held until its bytes complete (or the
  request ends). The window starts in the prompt's last tokens, so the first word gets its
  space.
- :class:`StopMatcher`: stop strings matched across step boundaries. A step commits several
  tokens, and a stop string may span tokens of different steps, so text that could be the
  start of a stop string is held back until it is known not to be; the text before the first
  stop string is the output, the stop string is not.
- :class:`TextStream`: one job's tokens -> (text delta, token ids delta, stopped), token by
  token, so a stop string ends the ids at the token that completed it.

The invariant the tests check: the concatenated deltas equal the non-streamed text (the same
class produces both), and equal the whole decode of the output ids when no stop string
intervenes.
"""
from __future__ import annotations

import threading
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
PROMPT_CONTEXT = 5        # prompt tokens the detokenization window starts with (vLLM uses 5)


class Tokenizer:
    """A Hugging Face `tokenizers` file; ids the file does not know decode to nothing."""

    def __init__(self, tok):
        self.tok = tok
        self.max_token_chars = _longest_token(tok)
        self._plain = None                  # a copy that encodes special tokens as text
        self._plain_lock = threading.Lock()

    @classmethod
    def load(cls, path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        path = Path(path)
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # noqa: BLE001 -- the library raises bare Exceptions on bad files
            raise ValueError(f"{path}: not a Hugging Face tokenizers file "
                             f"({str(e).splitlines()[0][:200]})") from None

    @classmethod
    def of_engine(cls, engine_dir) -> "Tokenizer | None":
        path = Path(engine_dir) / TOKENIZER_FILE
        return cls.load(path) if path.is_file() else None

    def encode(self, text: str) -> list[int]:
        """The ids of `text`. Through the batch call: `tokenizers` releases the GIL there and
        not in `encode` (a 2.2 MB text held it for 7.0 s in `encode`, while the batch call
        let other threads run every 67 ms at most), and `_fast` skips the offsets, which
        nothing here reads (2.8 s instead of 6.0 s). The server calls this off its event loop."""
        batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return list(batch([text])[0].ids)

    def encode_plain(self, text: str) -> list[int]:
        """The ids of `text` with its special tokens' strings encoded as characters (a chat
        message that spells `<|bos|>` is those characters, not BOS): a copy of the tokenizer
        with `encode_special_tokens` on, so the shared one never changes under other threads."""
        with self._plain_lock:
            if self._plain is None:
                plain = type(self.tok).from_str(self.tok.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
        batch = getattr(self._plain, "encode_batch_fast", self._plain.encode_batch)
        return list(batch([text], add_special_tokens=False)[0].ids)

    def special(self, text: str) -> int | None:
        """The id of `text` when it is one of the tokenizer's added tokens, else None."""
        i = self.tok.token_to_id(text)
        added = self.tok.get_added_tokens_decoder()
        return i if i is not None and i in added and added[i].content == text else None

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=self.skip_special)

    skip_special = True

    def keeping_special(self) -> "Tokenizer":
        """The same tokenizer, decoding special tokens to their strings (vLLM's
        skip_special_tokens: false)."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.skip_special = False
        return other


def _longest_token(tok) -> int | None:
    """The most characters of text one token can cover, where the tokenizer bounds it: a BPE
    model with no normalizer maps each character of the text to at least one character of its
    tokens' strings (byte-level BPE: one per UTF-8 byte; added tokens match their own string),
    so n characters are at least n / (the longest token string) tokens. None otherwise: a
    normalizer may drop text."""
    model = getattr(tok, "model", None)
    if getattr(tok, "normalizer", True) is not None or type(model).__name__ != "BPE":
        return None
    return max((len(t) for t in tok.get_vocab(with_added_tokens=True)), default=0) or None


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt: list[int] = ()):
        self.tok = tokenizer
        self.ids = list(prompt[-PROMPT_CONTEXT:])
        self.prefix = 0                 # window start
        self.read = len(self.ids)       # the text of ids up to here is given out
        self.sent = ""                  # text of ids[read:] given out already (complete chars)

    def add(self, token: int) -> str:
        """The text `token` completes: all of it but a trailing U+FFFD run, which may be a
        character whose bytes are still arriving (so a stop string is seen at the token that
        completes it, not when the next character does)."""
        return self.add_many((token,))

    def add_many(self, tokens) -> str:
        """The text `tokens` complete, in two decodes (a step's tokens of a request without
        stop strings: TextStream); with add()'s rules, so the text given out by the end of
        the output is the same whichever of the two fed it (tests/serve/test_text.py)."""
        self.ids += tokens
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if not now.startswith(before):       # a decoder that rewrote the window: next token
            return ""
        new = now[len(before):]
        stable = new.rstrip("\ufffd")
        if not stable.startswith(self.sent):
            return ""
        delta = stable[len(self.sent):]
        if stable == new and new:            # complete: the window moves on
            self.prefix, self.read, self.sent = self.read, len(self.ids), ""
        else:
            self.sent = stable
        return delta

    def flush(self) -> str:
        """At the end: what is still held (an incomplete character decodes as U+FFFD)."""
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        out = now[len(before):] if now.startswith(before) else ""
        out, self.sent = (out[len(self.sent):] if out.startswith(self.sent) else ""), ""
        return out


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stops)
        self.held = ""
        self.longest = max((len(s) for s in self.stops), default=0)

    def add(self, text: str) -> tuple[str, bool]:
        """(text that can be given out, whether a stop string ended the output)."""
        if not self.stops:
            return text, False
        pending = self.held + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return pending[:min(hits)], True
        keep = self._prefix_tail(pending)
        self.held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out

    def _prefix_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self.longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


class TextStream:
    """One job's output as it streams; without a tokenizer the text stays empty."""

    def __init__(self, tokenizer: Tokenizer | None, prompt: list[int],
                 stops: tuple[str, ...] = (), stop_ids: tuple[int, ...] = ()):
        self.detok = Detokenizer(tokenizer, prompt) if tokenizer is not None else None
        self.matcher = StopMatcher(stops)
        self.stop_ids = frozenset(stop_ids)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False          # a stop id or a stop string ended it

    def add(self, tokens: list[int]) -> tuple[str, list[int]]:
        """(text delta, ids delta) for newly committed `tokens`; after a stop string the rest
        of the step's tokens are dropped and `stopped` is set. Without stop strings, and with
        no stop id among them, a step's tokens are detokenized together (2 decodes a step
        instead of 2 a token: the event loop's largest per-token cost under load)."""
        if (not self.stopped and not self.matcher.stops
                and (not self.stop_ids or self.stop_ids.isdisjoint(tokens))):
            ids = list(tokens)
            delta = self.detok.add_many(ids) if self.detok is not None and ids else ""
            self.ids += ids
            self.text += delta
            return delta, ids
        text, ids = [], []
        for t in tokens:
            if self.stopped:
                break
            ids.append(t)
            if t in self.stop_ids:          # the stop id is in the ids, not in the text
                self.stopped = True
                text.append(self._final(self._flush_detok()))
                break
            piece = self.detok.add(t) if self.detok is not None else ""
            out, hit = self.matcher.add(piece)
            text.append(out)
            self.stopped = hit
        self.ids += ids
        delta = "".join(text)
        self.text += delta
        return delta, ids

    def finish(self) -> str:
        """The text still held at the end of the request (none after a stop string)."""
        if self.stopped:            # settled when it stopped
            return ""
        out = self._final(self._flush_detok())
        self.text += out
        return out

    def _final(self, text: str) -> str:
        """The output's last text: a stop string may still end it; else what was held."""
        out, hit = self.matcher.add(text)
        self.stopped = self.stopped or hit
        return out if hit else out + self.matcher.flush()

    def _flush_detok(self) -> str:
        return self.detok.flush() if self.detok is not None else ""
