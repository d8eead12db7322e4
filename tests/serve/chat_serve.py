"""`dspark-compile serve` in its own process over the stand-in stream (serve_helpers.FakeEngine)
with the trained tiny tokenizer (dspark_compile/factory/data/tiny-trained/tokenizer.json) and a scripted output:
every request's tokens spell SCRIPT (then `<|eos|>`), with `</think>` written as byte-level
tokens that FakeStream commits 1..3 a step, so the reasoning split meets the marker cut
across tokens and steps. What tests/serve/test_chat.py runs against."""
import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve import serve_helpers  # noqa: E402

from dspark_compile.cli.common import Terminated, sigterm_raises  # noqa: E402
from dspark_compile.serve.server import Server  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "dspark_compile" / "factory" / "data" / "tiny-trained"
# the pieces are encoded apart, so `</think>` is several byte-level tokens
SCRIPT = ("Two and two", " make four.</", "thi", "nk>", "The answer is 4.")
EOS = 1                                   # <|eos|> of the tiny tokenizer and FakeEngine


def script_ids() -> list[int]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    return [t for piece in SCRIPT for t in tok.encode(piece).ids] + [EOS]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--api-key")
    p.add_argument("--allowed-origins")
    args = p.parse_args()
    shutil.copy(TINY / "tokenizer.json", Path(args.dir) / "tokenizer.json")
    ids = script_ids()
    serve_helpers.fake_tokens = lambda prompt, seed, vocab, n: (ids * (n // len(ids) + 1))[:n]
    eng = serve_helpers.FakeEngine(args.dir)
    eng.cfg.bos_token_id = 0              # <|bos|>, as the tiny-trained config says
    extra = {}
    if args.api_key:
        extra["api_key"] = args.api_key
    if args.allowed_origins:
        extra["allowed_origins"] = args.allowed_origins.split(",")
    try:
        with sigterm_raises():
            Server(eng, model_name="tiny", **extra).run("127.0.0.1", 0,
                                                       log=lambda s: print(s, flush=True),
                                                       access_log=False)
    except Terminated:
        return 143
    return 0


if __name__ == "__main__":
    sys.exit(main())
