"""dspark_compile/factory/train.py: the corpus split, the tokenizers, a reduced training run end to end (twice:
deterministic for its seed; split in two processes, the same bytes), the distillation's pieces
(the teacher's top-p distribution, the soft loss, the loop count), and the committed tiny-trained
checkpoint (copied by synth, its report's acceptance re-measured in float64)."""
import json
import shutil
import sysconfig
from dataclasses import replace
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
from dspark_compile.factory.train import (
    TrainConfig, ci_check, draft_loss, ends_in_loop, main as train_main, teacher_probs,
    train_tiny)
from dspark_compile.factory.train_model import Rope, TrainParams
from dspark_compile.factory.random_weights import synth_tensors
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
    """Twice at the same seed and thread count: the same bytes -- the second run split in two
    processes' halves (--target-only, then --target-from), which must not change them."""
    corpus = _mini_corpus(tmp_path / "corpus")
    tc = TrainConfig.small(seed=3)
    train_tiny(tmp_path / "half", tc, corpus=corpus, target_only=True)
    reports = [train_tiny(tmp_path / "run0", tc, corpus=corpus),
               train_tiny(tmp_path / "run1", tc, corpus=corpus, target_from=tmp_path / "half")]
    a, b = (tmp_path / "run0", tmp_path / "run1")
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    rep = reports[0]
    modes = ("held_out_greedy", "held_out_sampled_token", "held_out_sampled_block")
    untimed = lambda r, k: {f: v for f, v in r[k].items() if f != "seconds"}  # noqa: E731
    for k in modes:
        assert untimed(rep, k) == untimed(reports[1], k), k
    assert rep["ci_float64"] == reports[1]["ci_float64"]
    assert rep["target"] == reports[1]["target"] and rep["target"]["held_out_loss"] > 0
    assert rep["corpus"]["held_out"] == ["fnmatch.py", "heapq.py"]
    for k in modes:
        acc = rep[k]
        assert len(acc["acceptance_per_position"]) == 5 and acc["row_steps"] > 0
        assert 1.0 <= acc["mean_accepted_length"] <= 6.0
    assert rep["held_out_sampled_block"]["sampling"] == {"temperature": 1.0, "top_p": 0.95,
                                                         "verify": "block"}
    assert 0 <= rep["held_out_greedy"]["ending_in_a_loop"] <= tc.eval_prompts
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
def test_committed_pair_reproduces_its_reported_acceptance_in_float64():
    """The committed pair, re-measured as train.py's ci_check measured it: greedy and sampled
    (token-wise and block verification) speculative decoding of the first held-out prompts with
    float64 activations (FP8 simulation kept), equal to the report's record.

    Why equality holds on any CPU, BLAS and thread count: acceptance counts change only when a
    token decision flips. In float64 a summation order moves a logit by ~1e-15 relative; a
    greedy flip needs the two best logits that close, a sampled one a probability (computed in
    fp32 from those logits) within an ulp of its philox uniform, an FP8 activation within 1e-15
    of a rounding boundary: ~1e-5 over the measurement's few thousand decisions. In float32 one
    CI machine flipped three greedy steps of 178, which is why the measurement is float64."""
    rep = json.loads((DATA_DIR / "train_report.json").read_text())
    cfg, tensors = load_checkpoint(DATA_DIR)
    held = encode_stream(load_tokenizer(DATA_DIR), Corpus.read(Corpus.stdlib().held_out),
                         cfg.eos_token_id)
    got = ci_check(cfg, tensors, held, rep["train_config"])
    assert got == rep["ci_float64"]


@committed
def test_committed_report_records_a_better_target_and_a_distilled_draft():
    """What issue 56 asked of the committed pair, as its report measured it on the 16 held-out
    prompts: held-out loss below 3.0 nats/token, fewer than half of the greedy continuations
    ending in a loop, and sampled (temperature 1, top-p 0.95) acceptance far above the
    greedy-only draft's 1.12-1.14 (token-wise, block) -- recorded floors, so that a retrained
    pair committed without them fails here."""
    rep = json.loads((DATA_DIR / "train_report.json").read_text())
    block, token = rep["held_out_sampled_block"], rep["held_out_sampled_token"]
    assert block["sampling"] == {"temperature": 1.0, "top_p": 0.95, "verify": "block"}
    assert token["sampling"] == {"temperature": 1.0, "top_p": 0.95, "verify": "token"}
    assert rep["target"]["held_out_loss"] < 3.0
    assert rep["held_out_greedy"]["ending_in_a_loop"] < rep["held_out_greedy"]["prompts"] / 2
    assert min(block["mean_accepted_length"], token["mean_accepted_length"]) >= 1.8


def test_teacher_is_the_samplers_top_p_distribution():
    """teacher_probs keeps the smallest set of largest tokens reaching top_p of the mass (the
    top token always), renormalised; temperature divides the logits first."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01]]))
    p = teacher_probs(logits, 1.0, 0.95)
    assert torch.allclose(p[0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=1e-6)
    assert torch.allclose(p[1], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    flat = teacher_probs(logits, 2.0, 1.0)[0]
    want = torch.softmax(logits[0] / 2.0, -1)
    assert torch.allclose(flat, want, atol=1e-6) and (flat > 0).all()


def _tiny_draft_case(seed: int = 0):
    cfg = ModelConfig.from_dict(preset("tiny-trained"))
    P = TrainParams(cfg, synth_tensors(cfg, seed))
    g = torch.Generator().manual_seed(seed)
    L, N = 24, cfg.dspark_block_size
    seqs = torch.randint(3, cfg.vocab_size, (2, L), generator=g)
    aux = torch.randn(2, L, len(cfg.dspark_target_layer_ids) * cfg.hidden_size, generator=g)
    last = torch.tensor([[3, 9], [5, L - N - 2]])
    return cfg, P, seqs, aux, last, Rope(cfg, 64)


def test_soft_draft_loss_on_one_hot_targets_is_the_hard_cross_entropy():
    """With the teacher one-hot on the sequence's next tokens, the distillation loss is the
    cross-entropy to those tokens (what the greedy-only recipe trained), weighted decay^k; a
    teacher spread over two tokens costs more than one on the draft's own favourite."""
    cfg, P, seqs, aux, last, rope = _tiny_draft_case()
    V, N = cfg.vocab_size, cfg.dspark_block_size
    onehot = torch.zeros(*seqs.shape, V)
    onehot[:, :-1].scatter_(-1, seqs[:, 1:, None], 1.0)
    loss, agree, overlap = draft_loss(P, aux, onehot, seqs, last, rope, 0.7)
    from dspark_compile.factory.train_model import draft_forward
    ar = torch.arange(N)
    anchors = seqs.gather(1, last + 1)
    prev = seqs.gather(1, (last[..., None] + 1 + ar).flatten(1)).view(*last.shape, N)
    labels = seqs.gather(1, (last[..., None] + 2 + ar).flatten(1)).view(*last.shape, N)
    logits = draft_forward(P, aux, anchors, last, prev, rope)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 2), labels.reshape(-1),
                                           reduction="none").view_as(labels)
    w = 0.7 ** ar.float()
    assert torch.allclose(loss, (ce * w).sum(-1).mean() / w.sum(), rtol=1e-5)
    want_agree = (logits.argmax(-1) == labels).float().flatten(0, 1).mean(0)
    assert torch.equal(agree, want_agree) and agree.shape == (N,)
    assert torch.allclose(overlap, torch.softmax(logits, -1).gather(
        -1, labels[..., None])[..., 0].flatten(0, 1).mean(0), rtol=1e-5)


def test_label_term_adds_the_hard_cross_entropy_to_the_teachers_argmax_per_row():
    """label_weight [B] adds, on each row, weight x the cross-entropy to the teacher's most likely
    token (decay^k weighted as the soft term); a row of weight 0 keeps the soft loss alone."""
    cfg, P, seqs, aux, last, rope = _tiny_draft_case(1)
    V, N = cfg.vocab_size, cfg.dspark_block_size
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(3 * torch.randn(*seqs.shape, V, generator=g), -1)
    soft, _, _ = draft_loss(P, aux, probs, seqs, last, rope, 0.7)
    lw = torch.tensor([0.5, 0.0])
    mixed, _, _ = draft_loss(P, aux, probs, seqs, last, rope, 0.7, lw)
    from dspark_compile.factory.train_model import draft_forward
    ar = torch.arange(N)
    anchors = seqs.gather(1, last + 1)
    prev = seqs.gather(1, (last[..., None] + 1 + ar).flatten(1)).view(*last.shape, N)
    at = (last[..., None] + 1 + ar).flatten(1)
    top = probs.argmax(-1).gather(1, at).view(*last.shape, N)
    logits = draft_forward(P, aux, anchors, last, prev, rope)
    hard = torch.nn.functional.cross_entropy(logits.flatten(0, 2), top.reshape(-1),
                                             reduction="none").view_as(top)
    w = 0.7 ** ar.float()
    extra = ((lw[:, None, None] * hard) * w).sum(-1).mean() / w.sum()
    assert extra > 0 and torch.allclose(mixed, soft + extra, rtol=1e-5)
    zero, _, _ = draft_loss(P, aux, probs, seqs, last, rope, 0.7, torch.zeros(2))
    assert torch.allclose(zero, soft, rtol=1e-6)


def test_unknown_label_rows_is_refused_before_any_work(tmp_path):
    tc = replace(TrainConfig.small(), label_rows="sampled")
    with pytest.raises(ValueError, match="label_rows must be 'greedy' or 'all'"):
        train_tiny(tmp_path / "out", tc)
    assert not (tmp_path / "out").exists()


def test_ends_in_loop_counts_short_periods_only():
    text = list(range(40))
    assert not ends_in_loop(text)
    assert ends_in_loop(text[:16] + [7] * 24)                       # period 1
    assert ends_in_loop(text[:10] + [1, 2, 3, 4, 5, 6, 7, 8] * 4)   # period 8
    assert not ends_in_loop(text[:10] + list(range(9)) * 4)         # period 9: not short
    assert not ends_in_loop([5] * 23)                                # shorter than the span


def test_target_from_refuses_a_target_of_another_config(tmp_path, capsys):
    """--target-from takes only a --target-only run of the same target config and tokenizer:
    anything else is a clear error naming the flag and the field, not a silently different
    pair."""
    corpus = _mini_corpus(tmp_path / "corpus")
    tc = TrainConfig.small(seed=3)
    first = tmp_path / "first"
    rep = train_tiny(first, tc, corpus=corpus, target_only=True)
    assert "held_out_greedy" not in rep and rep["target"]["held_out_loss"] > 0
    from dataclasses import replace
    with pytest.raises(ValueError, match=r"--target-from .*target_steps=3 \(here 4\)"):
        train_tiny(tmp_path / "x", replace(tc, target_steps=4), corpus=corpus,
                   target_from=first)
    with pytest.raises(FileNotFoundError, match="--target-from .*train_report.json"):
        train_tiny(tmp_path / "y", tc, corpus=corpus, target_from=tmp_path / "corpus")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "train_report.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="--target-from .*not a training report"):
        train_tiny(tmp_path / "v", tc, corpus=corpus, target_from=junk)
    (first / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="--target-from .*tokenizer.json is missing or differs"):
        train_tiny(tmp_path / "u", tc, corpus=corpus, target_from=first)
    with pytest.raises(ValueError, match="exclude each other"):
        train_tiny(tmp_path / "z", tc, corpus=corpus, target_only=True, target_from=first)
    assert train_main(["--out", str(tmp_path / "w"), "--small", "--target-from",
                       str(tmp_path / "corpus")]) == 1
    assert "error: --target-from" in capsys.readouterr().err


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
