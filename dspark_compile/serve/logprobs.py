"""Logprobs in the API's two shapes, from the engine's entries (runtime/logprobs.py: per token
(logprob, ((id, logprob), ... top k)), None for a prompt's first token).

    completions   {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (OpenAI's legacy
                  shape, as vLLM fills it): top_logprobs maps the top k tokens' strings and
                  the token's own to their logprobs (vLLM's: the chosen token is always
                  there, so `logprobs: 0` gives it alone; ids that decode to one string, such
                  as bytes of a multi-byte character, share one key: the likeliest's value);
                  text_offset counts characters of the token strings from the start of the
                  choice's text (with echo, the prompt's)
    chat          {"content": [{"token", "logprob", "bytes", "top_logprobs": [k entries]}]}

A token's string is the tokenizer's decode of that one id with special tokens kept (a byte
of a multi-byte character decodes to U+FFFD, as in vLLM); without a tokenizer it is vLLM's
`token_id:<id>`.
"""
from __future__ import annotations


class Pieces:
    """Token strings of one tokenizer, decoded once per id."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, i: int) -> str:
        s = self._cache.get(i)
        if s is None:
            s = (f"token_id:{i}" if self.tok is None
                 else self.tok.tok.decode([i], skip_special_tokens=False))
            if len(self._cache) < 1 << 18:
                self._cache[i] = s
        return s


class CompletionLogprobs:
    """One choice's completion logprobs, built a delta at a time (text_offset runs on)."""

    def __init__(self, pieces: Pieces):
        self.piece = pieces
        self.offset = 0

    def delta(self, ids: list[int], entries: list) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, e in zip(ids, entries):
            s = self.piece(t)
            out["tokens"].append(s)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp, top = e
            out["token_logprobs"].append(lp)
            tops: dict = {}
            for i, v in top:            # ids decoding to one string: the likeliest's value
                tops.setdefault(self.piece(i), v)
            tops.setdefault(s, lp)
            out["top_logprobs"].append(tops)
        return out


def merge(parts: list[dict]) -> dict | None:
    """Completion logprobs deltas concatenated (None: none)."""
    if not parts:
        return None
    return {k: [x for p in parts for x in p[k]] for k in parts[0]}


def chat_content(pieces: Pieces, ids: list[int], entries: list) -> list[dict]:
    """Chat's logprobs.content entries of `ids`."""
    out = []
    for t, (lp, top) in zip(ids, entries):
        s = pieces(t)
        out.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [{"token": pieces(i), "logprob": v,
                                      "bytes": list(pieces(i).encode("utf-8"))}
                                     for i, v in top]})
    return out
