"""Byte-level BPE tokenizers for the tiny checkpoints (Hugging Face `tokenizers`), `tokenizer.json`
beside the weights.

`train_bpe` builds one whose vocabulary is exactly the model's `vocab_size`, with the config's
special tokens at the config's ids: `<|bos|>` at bos_token_id, `<|eos|>` at eos_token_id and,
for a checkpoint with a DSpark draft, `<|noise|>` at dspark_noise_token_id (the mask token the
draft's block positions after the anchor hold; no text ever encodes to it). Byte-level: every
string encodes (256 byte tokens), and decoding any id sequence gives text (an incomplete UTF-8
sequence decodes to U+FFFD). Training is deterministic for its input (checked by
tests/models/test_train.py).

Command line (the demo prints text with it):

    python -m dspark_compile.factory.tokenizer decode CKPT_OR_TOKENIZER_JSON 11,12,13 [...]
    python -m dspark_compile.factory.tokenizer encode CKPT_OR_TOKENIZER_JSON "text" [--escapes]

`decode --from-run FILE` ('-' = stdin) decodes the `tokens[i]: 11,12,...` lines that
`dspark-compile run` and `generate` print.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TOKENIZER_NAME = "tokenizer.json"
BOS, EOS, NOISE = "<|bos|>", "<|eos|>", "<|noise|>"


def _special_ids(cfg) -> dict[str, int]:
    ids = {BOS: cfg.bos_token_id, EOS: cfg.eos_token_id}
    if cfg.has_draft:
        ids[NOISE] = cfg.dspark_noise_token_id
    if len(set(ids.values())) != len(ids):
        raise ValueError(f"tokenizer: special tokens need distinct ids, got {ids}")
    return ids


def train_bpe(texts: Iterable[str], cfg):
    """A byte-level BPE of exactly cfg.vocab_size tokens trained on `texts`, the special tokens
    at the config's ids. A text too small for that many merges leaves the rest of the vocabulary
    as `<|unused_i|>` special tokens (never produced by encoding)."""
    V = cfg.vocab_size
    specials = _special_ids(cfg)
    if V < 256 + len(specials):
        raise ValueError(f"tokenizer: vocab_size={V} is below the 256 byte tokens + "
                         f"{len(specials)} special tokens a byte-level BPE needs")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=V, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    n = len(vocab)
    # pad to V with unused special tokens (they sit in the vocabulary, nothing encodes to them)
    for i in range(V - n):
        name = f"<|unused_{i}|>"
        vocab[name] = n + i
        spec["added_tokens"].append(_added(name, n + i))
    _place_specials(spec, specials)
    return Tokenizer.from_str(json.dumps(spec))


def _added(content: str, i: int) -> dict:
    return {"id": i, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True}


def _place_specials(spec: dict, specials: dict[str, int]) -> None:
    """Move each special token to its id by swapping ids with whatever token held that id
    (BPE merges name tokens by string, so ids can be permuted freely)."""
    vocab = spec["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    for name, want in specials.items():
        have = vocab[name]
        other = by_id[want]
        vocab[name], vocab[other] = want, have
        by_id[want], by_id[have] = name, other
    added = {a["content"]: a for a in spec["added_tokens"]}
    for name, a in added.items():
        a["id"] = vocab[name]
    spec["added_tokens"] = sorted(added.values(), key=lambda a: a["id"])
    spec["model"]["vocab"] = dict(sorted(vocab.items(), key=lambda kv: kv[1]))


def builtin_text() -> list[str]:
    """The built-in training text of the random checkpoints' tokenizer: this package's model
    sources (shipped with it, so the same for every install of a version)."""
    here = Path(__file__).resolve().parent
    return [p.read_text(encoding="utf-8") for p in sorted(here.glob("*.py"))]


def write_tokenizer(tok, directory: str | Path) -> Path:
    path = Path(directory) / TOKENIZER_NAME
    path.write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    return path


def load_tokenizer(path: str | Path):
    """A checkpoint or engine directory holding tokenizer.json, or the file itself."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_NAME
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer: {p} not found (a checkpoint written by `synth` "
                                f"holds {TOKENIZER_NAME})")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:   # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"tokenizer: {p} is not a tokenizer.json ({e})") from None


def decode(tok, ids: list[int]) -> str:
    V = tok.get_vocab_size()
    bad = [i for i in ids if not 0 <= i < V]
    if bad:
        raise ValueError(f"tokenizer: ids {bad[:5]} outside [0, {V})")
    return tok.decode(ids, skip_special_tokens=False)


_RUN_LINE = re.compile(r"^(tokens\[\d+\]):\s*([-\d,\s]*)$")


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"ids: expected comma-separated integers, got {text!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_compile.factory.tokenizer",
                                 description="encode / decode with a checkpoint's tokenizer.json")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode", help="ids -> text")
    d.add_argument("tokenizer", help="checkpoint / engine directory or tokenizer.json")
    d.add_argument("ids", nargs="*", help="comma-separated ids (repeatable)")
    d.add_argument("--from-run", metavar="FILE", help="decode the `tokens[i]: ...` lines of "
                   "`dspark-compile run` output ('-' = stdin)")
    e = sub.add_parser("encode", help="text -> ids")
    e.add_argument("tokenizer")
    e.add_argument("text")
    e.add_argument("--escapes", action="store_true",
                   help="read backslash escapes in TEXT (\\n, \\t, \\\\) as the characters")
    args = ap.parse_args(argv)
    try:
        tok = load_tokenizer(args.tokenizer)
        if args.cmd == "encode":
            text = _unescape(args.text) if args.escapes else args.text
            print(",".join(str(i) for i in tok.encode(text).ids))
            return 0
        groups = [("ids", _parse_ids(s)) for s in args.ids]
        if args.from_run:
            src = sys.stdin if args.from_run == "-" else open(args.from_run, encoding="utf-8")
            with src:
                for line in src:
                    m = _RUN_LINE.match(line.strip())
                    if m:
                        groups.append((m.group(1), _parse_ids(m.group(2))))
        if not groups:
            raise ValueError("decode: give ids or --from-run")
        for label, ids in groups:
            print(f"{label} text: {decode(tok, ids)!r}")
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
