"""dspark_compile/factory/train.py: the corpus split, the tokenizers, a reduced training run end to end (twice:
deterministic for its seed), and the committed tiny-trained checkpoint (copied by synth, its
report's acceptance re-measured)."""
import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from dspark_compile.models.checkpoint import load_checkpoint
from dspark_compile.models.config import ModelConfig
from dspark_compile.factory.presets import preset
from dspark_compile.factory.tokenizer import (
    BOS, EOS, NOISE, decode, load_tokenizer, main as tokenizer_main, train_bpe)
from dspark_compile.factory import synth
from dspark_compile.factory.committed import DATA_DIR, committed_seed
from dspark_compile.factory.train import TrainConfig, measure_acceptance, train_tiny
from dspark_compile.factory.train_data import Corpus, encode_stream, spaced_windows

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_held_out_modules_are_exactly_those_starting_with_f_g_h():
    c = Corpus.stdlib()
    everything = sorted(p.name for p in STDLIB.glob("*.py"))
    assert sorted(p.name for p in c.train + c.held_out) == everything
    assert c.held_out and all(p.name[0] in "fgh" for p in c.held_out)
    assert c.train and not any(p.name[0] in "fghFGH" for p in c.train)
    assert {"functools.py", "gzip.py", "heapq.py"} <= {p.name for p in c.held_out}


def test_corpus_without_a_held_out_file_is_refused(tmp_path):
    (tmp_path / "abc.py").write_text("x = 1\n")
    with pytest.raises(FileNotFoundError, match="held-out"):
        Corpus.stdlib(tmp_path)


@pytest.mark.parametrize("name", ["tiny", "tiny-trained"])
def test_tokenizer_has_the_model_vocab_and_the_config_special_ids(name):
    cfg = ModelConfig.from_dict(preset(name))
    text = (STDLIB / "bisect.py").read_text()
    tok = train_bpe([text], cfg)       # one small file: the vocabulary is padded
    assert tok.get_vocab_size() == cfg.vocab_size
    assert tok.token_to_id(BOS) == cfg.bos_token_id and tok.token_to_id(EOS) == cfg.eos_token_id
    assert tok.token_to_id(NOISE) == cfg.dspark_noise_token_id
    ids = tok.encode(text).ids
    assert decode(tok, ids) == text
    assert cfg.dspark_noise_token_id not in ids and max(ids) < cfg.vocab_size
    assert train_bpe([text], cfg).to_str() == tok.to_str()     # deterministic
    with pytest.raises(ValueError, match=r"outside \[0, 512\)"):
        decode(tok, [0, 512])


def test_tokenizer_cli_decodes_run_output(tmp_path, capsys):
    cfg = ModelConfig.from_dict(preset("tiny-trained"))
    tok = train_bpe([(STDLIB / "bisect.py").read_text()], cfg)
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    ids = tok.encode("def f(x):\n    return x\n").ids
    run_out = tmp_path / "run.txt"
    run_out.write_text(f"tokens[0]: {','.join(map(str, ids))}\nmean accepted length: 2\n")
    assert tokenizer_main(["decode", str(tmp_path), "--from-run", str(run_out)]) == 0
    assert capsys.readouterr().out == "tokens[0] text: 'def f(x):\\n    return x\\n'\n"
    assert tokenizer_main(["decode", str(tmp_path / "missing")]) == 1
    assert "not found" in capsys.readouterr().err


def _mini_corpus(root: Path) -> Corpus:
    root.mkdir()
    for name in ("bisect.py", "colorsys.py", "keyword.py", "heapq.py", "fnmatch.py"):
        shutil.copy(STDLIB / name, root / name)
    return Corpus.stdlib(root)


def test_reduced_training_run_is_deterministic_and_loadable(tmp_path):
    corpus = _mini_corpus(tmp_path / "corpus")
    tc = TrainConfig.small(seed=3)
    reports = [train_tiny(tmp_path / f"run{i}", tc, corpus=corpus) for i in range(2)]
    a, b = (tmp_path / "run0", tmp_path / "run1")
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    rep = reports[0]
    untimed = lambda r: {k: v for k, v in r["held_out_greedy"].items() if k != "seconds"}  # noqa: E731
    assert untimed(rep) == untimed(reports[1])
    assert rep["corpus"]["held_out"] == ["fnmatch.py", "heapq.py"]
    acc = rep["held_out_greedy"]
    assert len(acc["acceptance_per_position"]) == 5 and acc["row_steps"] > 0
    assert 1.0 <= acc["mean_accepted_length"] <= 6.0
    assert json.loads((a / "train_report.json").read_text()) == json.loads(json.dumps(rep))
    cfg, tensors = load_checkpoint(a)          # validated against the schema
    assert cfg == ModelConfig.from_dict(preset("tiny-trained"))
    assert load_tokenizer(a).get_vocab_size() == cfg.vocab_size
    with pytest.raises(FileExistsError, match="not empty"):
        train_tiny(a, tc, corpus=corpus)


committed = pytest.mark.skipif(not (DATA_DIR / "train_report.json").is_file(),
                               reason="no committed tiny-trained checkpoint")


@committed
def test_synth_tiny_trained_copies_the_committed_checkpoint(tmp_path):
    from dspark_compile.factory.synth import synth_checkpoint
    out = synth_checkpoint("tiny-trained", tmp_path / "ckpt")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in DATA_DIR.iterdir())
    for p in DATA_DIR.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    with pytest.raises(ValueError, match="trained checkpoint"):
        synth_checkpoint("tiny-trained", tmp_path / "other", shard_size_bytes=1 << 20)


@committed
def test_committed_checkpoint_meets_its_report_on_held_out_prompts():
    rep = json.loads((DATA_DIR / "train_report.json").read_text())
    tc = rep["train_config"]
    cfg, tensors = load_checkpoint(DATA_DIR)
    tok = load_tokenizer(DATA_DIR)
    corpus = Corpus.stdlib()
    held = encode_stream(tok, Corpus.read(corpus.held_out), cfg.eos_token_id)
    prompts = spaced_windows(held, tc["eval_prompts"], tc["prompt_len"]).tolist()
    torch.set_num_threads(tc["threads"])
    got = measure_acceptance(cfg, tensors, prompts, tc["eval_new_tokens"])
    want = rep["held_out_greedy"]
    # The target (issue: mean accepted length >= 3.0 of 6) holds on every machine; the report's
    # own numbers hold to a few of its 178 row steps: greedy continuations flip at near-ties with
    # the CPU's sgemm kernel (one 2-core CI machine measured 0.8927 for the report's 0.8764, three
    # steps), so each position may move by 0.05 (nine steps) and no more (the mean is 1 + their
    # sum, bounded with them).
    assert got["mean_accepted_length"] >= 3.0
    assert got["acceptance_per_position"] == pytest.approx(want["acceptance_per_position"],
                                                           abs=0.05)


def test_synth_tiny_writes_a_tokenizer(tmp_path):
    from dspark_compile.factory.synth import synth_checkpoint
    out = synth_checkpoint("tiny", tmp_path / "ckpt")
    tok = load_tokenizer(out)
    cfg = ModelConfig.from_dict(preset("tiny"))
    assert tok.get_vocab_size() == cfg.vocab_size
    assert tok.token_to_id(NOISE) == cfg.dspark_noise_token_id == 500
    again = synth_checkpoint("tiny", tmp_path / "again")
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    # --overwrite replaces a checkpoint that holds its tokenizer
    synth_checkpoint("tiny", out, overwrite=True)


def test_synth_tiny_trained_for_another_seed_trains_that_seed(tmp_path, monkeypatch):
    """Only the committed seed is copied; any other seed is a training run with that seed (here
    recorded instead of run: minutes), writing the requested directory."""
    runs = []
    monkeypatch.setattr(synth, "train_tiny",
                        lambda out, tc, overwrite=False: runs.append((Path(out), tc.seed, overwrite)))
    seed = (committed_seed() or 0) + 7
    out = synth.synth_checkpoint("tiny-trained", tmp_path / "ckpt", seed=seed)
    assert out == tmp_path / "ckpt" and runs == [(tmp_path / "ckpt", seed, False)]
