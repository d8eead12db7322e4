"""Incremental detokenization and stop strings across step boundaries
(dspark_compile/serve/text.py)."""
import random

import pytest

from serve.serve_helpers import TEXT, train_tokenizer

from dspark_compile.serve.text import Detokenizer, StopMatcher, TextStream, Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.load(train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def stream_text(tok, ids, prompt=()):
    d = Detokenizer(tok, list(prompt))
    return [d.add(t) for t in ids] + [d.flush()]


def test_multibyte_characters_are_never_split_into_replacement_chars(tok):
    text = "na\u00efve \u65e5\u672c\u8a9e \U0001F680 caf\u00e9"
    ids = tok.encode(text)
    pieces = stream_text(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces), pieces
    # the 4-byte rocket is split over byte-level tokens: some step gives out nothing
    assert len(ids) > len(text.split())


def test_random_ids_stream_to_the_whole_decode(tok):
    """Arbitrary ids (what a random model commits: invalid UTF-8, ids the file lacks) stream to
    exactly the decode of all of them."""
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(0, 520) for _ in range(rng.randrange(1, 40))]
        assert "".join(stream_text(tok, ids)) == tok.decode(ids)


def test_prompt_context_keeps_the_first_words_space(tok):
    prompt = tok.encode("The quick brown")
    out = tok.encode(" fox jumps")
    assert "".join(stream_text(tok, out, prompt)) == " fox jumps"


def test_stop_string_split_over_deltas_is_found_and_held_back():
    m = StopMatcher(("STOP",))
    assert m.add("abc S") == ("abc ", False)       # "S" could start STOP: held
    assert m.add("T") == ("", False)
    assert m.add("Oxyz") == ("STOxyz", False)      # "STOx" is not STOP: all released
    m = StopMatcher(("STOP",))
    out = [m.add(x) for x in ("abc S", "T", "O", "P and more")]
    assert out == [("abc ", False), ("", False), ("", False), ("", True)]


def test_held_text_is_released_once_it_cannot_start_a_stop_string():
    m = StopMatcher(("STOP",))
    assert m.add("xS") == ("x", False)
    assert m.add("Tx") == ("STx", False)
    assert m.add("ST") == ("", False)
    assert m.flush() == "ST"


def test_earliest_of_several_stop_strings_wins():
    m = StopMatcher(("world", "lo w"))
    assert m.add("hello world") == ("hel", True)


def test_no_stop_strings_passes_text_through():
    m = StopMatcher(())
    assert m.add("anything") == ("anything", False) and m.flush() == ""


def test_stop_string_ends_ids_at_the_token_that_completed_it(tok):
    prompt = tok.encode("The")
    ids = tok.encode(" quick brown fox jumps over the lazy dog")
    full = tok.decode(ids)
    ts = TextStream(tok, prompt, stops=("fox",))
    steps = [ids[i:i + 3] for i in range(0, len(ids), 3)]     # three tokens per "step"
    text = ""
    for s in steps:
        delta, got = ts.add(s)
        text += delta
        if ts.stopped:
            break
    text += ts.finish()
    assert ts.stopped and text == full[:full.index("fox")] == ts.text
    # the ids end with the token that completed "fox", the rest of that step is dropped
    assert ids[:len(ts.ids)] == ts.ids
    assert "fox" in tok.decode(ts.ids) and "fox" not in tok.decode(ts.ids[:-1])


def test_stop_id_is_in_the_ids_not_in_the_text(tok):
    ids = tok.encode(" lazy dog")
    ts = TextStream(tok, [], stop_ids=(ids[-1],))
    delta, got = ts.add(ids + [5, 6])
    assert got == ids and ts.stopped
    assert delta + ts.finish() == tok.decode(ids[:-1])


def test_streamed_text_equals_unstreamed_text_at_any_split(tok):
    rng = random.Random(1)
    ids = tok.encode(TEXT[:200])
    whole = TextStream(tok, [3, 4], stops=("kernels",))
    whole.add(ids)
    whole.finish()
    for _ in range(20):
        ts, pos = TextStream(tok, [3, 4], stops=("kernels",)), 0
        while pos < len(ids) and not ts.stopped:
            n = rng.randint(1, 6)
            ts.add(ids[pos:pos + n])
            pos += n
        ts.finish()
        assert (ts.text, ts.ids) == (whole.text, whole.ids)


def test_without_a_tokenizer_text_stays_empty_and_ids_flow():
    ts = TextStream(None, [1, 2], stop_ids=(9,))
    assert ts.add([4, 5]) == ("", [4, 5])
    assert ts.add([9, 7]) == ("", [9]) and ts.stopped


def test_a_bad_tokenizer_file_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a Hugging Face tokenizers file"):
        Tokenizer.load(bad)


class BytesTokenizer:
    """Ids are byte strings: decode joins them and replaces invalid UTF-8, as byte-level BPE."""

    def decode(self, ids):
        return b"".join(ids).decode("utf-8", errors="replace")


def test_text_before_an_incomplete_character_is_given_out_at_once():
    d = Detokenizer(BytesTokenizer(), [b"x"])
    rocket = "\U0001F680".encode()
    assert d.add(b"a") == "a"
    assert d.add(b"b" + rocket[:2]) == "b"          # "b" now, the rocket's bytes held
    assert d.add(rocket[2:]) == "\U0001F680"
    assert d.add(b"\xff") == "" and d.flush() == "\ufffd"   # invalid for good: out at the end


def test_a_stop_string_is_seen_at_the_token_that_completes_it():
    rocket = "\U0001F680".encode()
    ts = TextStream(BytesTokenizer(), [], stops=("ab",))
    ts.detok = Detokenizer(BytesTokenizer(), [])
    ts.add([b"a"])
    delta, ids = ts.add([b"b" + rocket[:2], rocket[2:]])
    assert ts.stopped and ids == [b"b" + rocket[:2]] and ts.text == ""


def test_a_steps_tokens_detokenized_together_give_the_per_token_text(tok):
    """Without stop strings TextStream detokenizes a step's tokens in one go (add_many): at
    every step boundary the text given out equals feeding them one at a time, and the whole
    output is the whole decode -- random ids (invalid UTF-8, unknown ids) and multi-byte text,
    at random splits."""
    rng = random.Random(2)
    cases = [tok.encode(TEXT)] + [[rng.randrange(0, 520) for _ in range(rng.randrange(1, 60))]
                                  for _ in range(30)]
    for k, ids in enumerate(cases):
        prompt = [rng.randrange(0, 512) for _ in range(3)] if k % 2 else []
        one, many, pos = Detokenizer(tok, prompt), TextStream(tok, prompt), 0
        got_one = ""
        while pos < len(ids):
            n = rng.randint(1, 6)
            got_one += "".join(one.add(t) for t in ids[pos:pos + n])
            delta, got = many.add(ids[pos:pos + n])
            assert got == ids[pos:pos + n]
            pos += n
            assert many.text == got_one
        assert many.text + many.finish() == got_one + one.flush()
        assert many.ids == ids
        if not prompt:
            assert many.text == tok.decode(ids)


def test_a_step_holding_a_stop_id_still_ends_at_it(tok):
    """The batched path is taken only when no stop id is among the step's tokens."""
    ids = tok.encode(" the lazy dog jumps")
    ts = TextStream(tok, [], stop_ids=(ids[2],))
    assert ts.add(ids[:2])[1] == ids[:2] and not ts.stopped
    delta, got = ts.add(ids[2:])
    assert got == [ids[2]] and ts.stopped
    assert ts.text + ts.finish() == tok.decode(ids[:2])
