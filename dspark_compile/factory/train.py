"""Train the tiny DeepSeek-V4 target and its DSpark draft, so acceptance is a real number.

    python -m dspark_compile.factory.train --out DIR [--seed 0] [--threads 1] [--small]
    python -m dspark_compile.factory.train --out T --target-only      # the pipeline in two
    python -m dspark_compile.factory.train --out DIR --target-from T  # processes: same bytes

The pipeline (each stage deterministic for the seed at a fixed thread count):

1. corpus: the standard library's top-level modules, those starting with f, g or h held out
   (dspark_compile/factory/train_data.py);
2. tokenizer: a byte-level BPE of the model's vocabulary on the training files
   (dspark_compile/factory/tokenizer.py);
3. target: the `tiny-trained` shapes (every layer type of `tiny`), initialised as `synth`
   does, trained on next-token cross-entropy in fp32 (dspark_compile/factory/train_model.py),
   then stored in its formats (FP8 block-scaled linears, MXFP4 experts, bf16 tables); its
   held-out loss measured on evenly spaced held-out windows;
4. draft data: the *stored* target (the reference model with FP8 activation and KV
   simulation, as the engine runs it) continues training-corpus prompts, greedily and sampled
   at the model card's temperature 1.0 / top-p 0.95; the stored target (recomputed in fp32)
   gives, on each continuation, its hidden states and its sampling distribution after every
   position (softmax(logits / T) restricted to top-p, as kernels/sampling/reference.py does);
5. draft: DSpark's recipe -- blocks of [anchor, noise x (N - 1)] after random committed
   positions of those continuations, conditioned on the target's hidden states, the Markov head
   fed the previous token of the continuation, distilled on the target's distributions (the
   cross-entropy to them, i.e. the KL up to the teacher's entropy), plus on the greedy
   continuations the cross-entropy to the target's most likely token (what greedy verification
   accepts), with weight decay^k at draft position k (the first drafts decide most of the
   accepted length); the target's embedding and LM head are shared and frozen;
6. measurement: speculative decoding of the stored pair (the reference eager loop with FP8
   simulation) on prompts from the held-out files, greedy and sampled (token-wise and block
   verification): acceptance per draft position, the mean accepted length, how many greedy
   continuations end in a short loop; and the CI's float64 re-measurement (`ci_check`);
   written to train_report.json with the losses and timings.

The committed checkpoint dspark_compile/factory/data/tiny-trained is this script's output for
TrainConfig(); `synth --preset tiny-trained` copies it (dspark_compile/factory/committed.py).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark_compile.factory.checkpoint_dir import TRAIN_REPORT_NAME, write_checkpoint
from dspark_compile.factory.committed import PRESET
from dspark_compile.factory.presets import preset
from dspark_compile.factory.random_weights import synth_tensors
from dspark_compile.factory.tokenizer import TOKENIZER_NAME, train_bpe
from dspark_compile.factory.train_data import Corpus, encode_stream, spaced_windows, windows
from dspark_compile.factory.train_model import Rope, TrainParams, draft_forward, target_forward
from dspark_compile.kernels.sampling.reference import process_logits
from dspark_compile.models import load_model
from dspark_compile.models.config import ModelConfig, Precision
from dspark_compile.models.generate import generate
from dspark_compile.models.request import SamplingParams

MAX_POSITIONS = 512


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    # torch CPU threads while training (results depend on it). One: on a shared 2-core machine
    # (load ~6) a target step of 512 tokens took 1.1 s with one thread and 4-21 s with two,
    # whose OpenMP barriers wait on descheduled threads.
    threads: int = 1
    # target: next-token prediction on corpus windows. 1000 steps of 8 x 128 tokens (1.0 M
    # tokens, half an epoch): the held-out loss falls below 3 nats/token; 128 covers the
    # measurement's 32 + 48 positions (the compressors' ratio-128 entry included)
    target_steps: int = 1000
    target_batch: int = 8
    target_seq: int = 128
    target_lr: float = 4e-3
    target_warmup: int = 50
    held_out_windows: int = 64   # held-out loss: this many evenly spaced windows of target_seq
    # draft data: the stored target's continuations of training-corpus prompts, greedy and
    # sampled (temperature 1, top-p 0.95: the model card's sampling). 1,792 of them (115 k
    # positions, ~480 s): with 384 the draft fit them (teacher-forced overlap 0.81 at draft
    # position 0) and held-out greedy acceptance stopped at 2.70 after 2,000 steps
    continuations: int = 768
    sampled_continuations: int = 1024
    prompt_len: int = 32
    continuation_len: int = 64
    # draft: distilled on the target's next-token distributions at the sampling temperature,
    # top-p applied (the verifier's p is the top-p distribution: mass outside it is never
    # accepted)
    teacher_temperature: float = 1.0
    teacher_top_p: float = 0.95
    # 10,000 steps (3,732 s, one thread, with the label term below): held-out greedy 4.31,
    # sampled 2.50 / 2.69 (token / block); the teacher-forced overlap plateaus from ~6,000 on
    draft_steps: int = 10000
    draft_batch: int = 8        # continuations per step
    anchors: int = 16           # blocks per continuation per step
    draft_lr: float = 6e-3
    position_decay: float = 0.7  # loss weight of draft position k: position_decay ** k
    # a hard-label term added to the distillation loss: label_weight x the cross-entropy to the
    # target's most likely token, on the rows of greedy continuations only (label_rows
    # "greedy") or on all. Distillation alone, 10,000 steps: greedy 3.79, sampled 2.84 / 2.89
    # (token / block); weight 1.0 on greedy rows: 4.31, 2.50 / 2.69; 0.5 on all rows: 4.14,
    # 2.45 / 2.69 (the same target and steps, 2026-12-08)
    label_weight: float = 1.0
    label_rows: str = "greedy"
    fake_quant: bool = False    # train through the stored formats (straight-through; ~3x slower)
    warmup: int = 20            # linear warm-up steps of the draft (then cosine to 10 %)
    # measurement: held-out prompts (greedy; sampled with token-wise and block verification)
    eval_prompts: int = 16
    eval_new_tokens: int = 48
    # the CI's check (tests/models/test_train.py): float64 on the first few prompts
    ci_prompts: int = 4
    ci_new_tokens: int = 24

    @classmethod
    def small(cls, seed: int = 0) -> "TrainConfig":
        """Seconds, not minutes: the CI's check that the script runs end to end."""
        return cls(seed=seed, threads=1, target_steps=3, target_batch=2, target_seq=32,
                   target_warmup=1, held_out_windows=2,
                   continuations=2, sampled_continuations=2, prompt_len=8,
                   continuation_len=10, draft_steps=3, draft_batch=2, anchors=4, warmup=1,
                   eval_prompts=2, eval_new_tokens=6, ci_prompts=1, ci_new_tokens=4)


class Progress:
    """One stderr line per stage, rewritten in place: `label [#####.....] i/n  metrics  time`."""

    def __init__(self, label: str, total: int, stream=None, width: int = 24):
        self.label, self.total, self.width = label, max(total, 1), width
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()

    def update(self, done: int, note: str = "") -> None:
        frac = min(done / self.total, 1.0)
        bar = "#" * round(frac * self.width)
        self.stream.write(f"\r{self.label:<8} [{bar:<{self.width}}] {done}/{self.total} {note} "
                          f"{time.perf_counter() - self.t0:.0f}s ")
        self.stream.flush()

    def close(self, note: str = "") -> float:
        self.update(self.total, note)
        self.stream.write("\n")
        self.stream.flush()
        return time.perf_counter() - self.t0


def _lr(step: int, steps: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _optimizer(params, lr: float):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)


def _step(opt, params, loss, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def train_target(P: TrainParams, stream: torch.Tensor, tc: TrainConfig, rope: Rope,
                 gen: torch.Generator, stream_out=None) -> dict:
    params = [p for n in P.names() if not n.startswith("mtp.") for p in P.group(n)]
    opt = _optimizer(params, tc.target_lr)
    bar = Progress("target", tc.target_steps, stream_out)
    losses, curve = [], []
    for step in range(tc.target_steps):
        seq = windows(stream, tc.target_batch, tc.target_seq + 1, gen)
        logits = target_forward(P, seq[:, :-1], rope)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))
        _step(opt, params, loss, _lr(step, tc.target_steps, tc.target_lr, tc.target_warmup))
        losses.append(float(loss.detach()))
        if (step + 1) % 100 == 0:
            curve.append(round(sum(losses[-100:]) / 100, 4))
        bar.update(step + 1, f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    seconds = bar.close(f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return {"seconds": seconds, "loss_first": losses[0],
            "loss_last20": sum(losses[-20:]) / len(losses[-20:]),
            "loss_per_100_steps": curve}


@torch.no_grad()
def held_out_loss(S: TrainParams, held: torch.Tensor, n: int, length: int, rope: Rope) -> float:
    """Mean next-token cross-entropy (nats/token) of the target S on n evenly spaced held-out
    windows of `length` predicted tokens (fp32, no FP8 activation simulation)."""
    seqs = spaced_windows(held, n, length + 1)
    total = 0.0
    for i in range(0, n, 16):
        seq = seqs[i:i + 16]
        logits = target_forward(S, seq[:, :-1], rope)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       seq[:, 1:].reshape(-1), reduction="sum"))
    return total / (n * length)


def reference_model(cfg: ModelConfig, tensors: dict, prec: Precision | None = None):
    return load_model(None, prec or Precision(torch.float32), MAX_POSITIONS, tensors=tensors,
                      cfg=cfg)


def continuations(cfg: ModelConfig, tensors: dict, prompts: torch.Tensor, new: int,
                  params: list[SamplingParams] | None = None, stream_out=None,
                  label: str = "continue") -> torch.Tensor:
    """[n, prompt + new]: each prompt and the stored target's continuation (reference decoding
    with FP8 simulation, in batches of 64 rows): greedy, or sampled with `params` (one a row)."""
    model = reference_model(cfg, tensors)
    params = params or [SamplingParams(max_new_tokens=new) for _ in range(prompts.shape[0])]
    bar = Progress(label, prompts.shape[0], stream_out)
    out = []
    for i in range(0, prompts.shape[0], 64):
        chunk = prompts[i:i + 64].tolist()
        res = generate(model, chunk, params[i:i + 64], speculative=False)
        out.extend(p + t for p, t in zip(chunk, res.tokens))
        bar.update(len(out))
    bar.close()
    return torch.tensor(out, dtype=torch.int64)


def teacher_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampler's distribution of logits [..., V] (kernels/sampling/reference.py: logits / T,
    top-p), fp32."""
    flat = logits.reshape(-1, logits.shape[-1])
    n = flat.shape[0]
    z = process_logits(flat, torch.full((n,), temperature), torch.zeros(n, dtype=torch.int64),
                       torch.full((n,), top_p))
    return torch.softmax(z, -1).view_as(logits)


@torch.no_grad()
def target_teacher(S: TrainParams, seqs: torch.Tensor, rope: Rope, tc: TrainConfig):
    """The stored target on seqs [n, L] (fp32): its hidden states for the draft [n, L, nL*D]
    and its sampling distribution after every position [n, L, V]."""
    aux, probs = [], []
    for i in range(0, seqs.shape[0], 16):
        logits, h = target_forward(S, seqs[i:i + 16], rope, aux=True)
        aux.append(h)
        probs.append(teacher_probs(logits, tc.teacher_temperature, tc.teacher_top_p))
    return torch.cat(aux), torch.cat(probs)


def draft_loss(P: TrainParams, aux: torch.Tensor, probs: torch.Tensor, seqs: torch.Tensor,
               last: torch.Tensor, rope: Rope, decay: float,
               label_weight: torch.Tensor | None = None):
    """Loss of the blocks drafted after positions last [B, A] of seqs [B, L]: the cross-entropy
    of the draft's distribution to the target's (probs [B, L, V], after each position), weight
    decay^k at draft position k; `label_weight` [B]: plus, on each row, that weight x the
    cross-entropy to the target's most likely token. Also, per position [N] (teacher-forced):
    top-1 agreement with the target's most likely token, and the overlap sum_v min(p, q) --
    what token-wise verification would accept there at the teacher's sampling."""
    N = P.cfg.dspark_block_size
    ar = torch.arange(N)
    anchors = seqs.gather(1, last + 1)
    prev = seqs.gather(1, (last[..., None] + 1 + ar).flatten(1)).view(*last.shape, N)
    at = (last[..., None] + 1 + ar).flatten(1)                  # draft k predicts after at[k]
    p = probs.gather(1, at[..., None].expand(-1, -1, probs.shape[-1])).view(
        *last.shape, N, probs.shape[-1])
    logits = draft_forward(P, aux, anchors, last, prev, rope)
    logq = torch.log_softmax(logits, -1)
    ce = -(p * logq).sum(-1)                                    # [B, A, N]
    if label_weight is not None:                                # [B]: the hard-label term
        hard = -logq.gather(-1, p.argmax(-1, keepdim=True))[..., 0]
        ce = ce + label_weight[:, None, None] * hard
    w = decay ** ar.to(ce.dtype)
    loss = (ce * w).sum(-1).mean() / w.sum()
    with torch.no_grad():
        agree = (logits.argmax(-1) == p.argmax(-1)).float().flatten(0, 1).mean(0)
        overlap = torch.minimum(p, logq.exp()).sum(-1).flatten(0, 1).mean(0)
    return loss, agree, overlap


def train_draft(P: TrainParams, seqs: torch.Tensor, aux: torch.Tensor, probs: torch.Tensor,
                tc: TrainConfig, rope: Rope, gen: torch.Generator, stream_out=None) -> dict:
    cfg = P.cfg
    N = cfg.dspark_block_size
    params = P.group("mtp.")
    opt = _optimizer(params, tc.draft_lr)
    lo, hi = tc.prompt_len - 1, seqs.shape[1] - N - 2   # anchors are the target's own tokens
    if hi < lo:
        raise ValueError(f"train: continuation_len={tc.continuation_len} leaves no draft block "
                         f"(needs >= {N + 2} tokens)")
    row_label = torch.full((seqs.shape[0],), tc.label_weight)
    if tc.label_rows == "greedy":
        row_label[tc.continuations:] = 0.0          # seqs: the greedy continuations first
    bar = Progress("draft", tc.draft_steps, stream_out)
    losses, agree, overlap = [], None, None
    for step in range(tc.draft_steps):
        rows = torch.randint(0, seqs.shape[0], (tc.draft_batch,), generator=gen)
        last = torch.randint(lo, hi + 1, (tc.draft_batch, tc.anchors), generator=gen)
        loss, a, o = draft_loss(P, aux[rows], probs[rows], seqs[rows], last, rope,
                                tc.position_decay, row_label[rows] if tc.label_weight else None)
        _step(opt, params, loss, _lr(step, tc.draft_steps, tc.draft_lr, tc.warmup))
        losses.append(float(loss.detach()))
        agree = a if agree is None else 0.9 * agree + 0.1 * a
        overlap = o if overlap is None else 0.9 * overlap + 0.1 * o
        bar.update(step + 1, f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f} overlap "
                   + " ".join(f"{x:.2f}" for x in overlap.tolist()))
    seconds = bar.close()
    return {"seconds": seconds, "loss_first": losses[0],
            "loss_last20": sum(losses[-20:]) / len(losses[-20:]),
            "teacher_forced_agreement": [round(x, 4) for x in agree.tolist()],
            "teacher_forced_overlap": [round(x, 4) for x in overlap.tolist()]}


def ends_in_loop(tokens: list[int], max_period: int = 8, span: int = 24) -> bool:
    """Whether the last `span` tokens repeat with a period <= max_period (a continuation stuck
    in a short loop)."""
    tail = tokens[-span:]
    return len(tail) == span and any(all(tail[j] == tail[j + p] for j in range(span - p))
                                     for p in range(1, max_period + 1))


SAMPLED = {"temperature": 1.0, "top_p": 0.95}    # the model card's sampling


def measure_acceptance(cfg: ModelConfig, tensors: dict, prompts: list[list[int]], new: int,
                       prec: Precision | None = None, verify: str | None = None) -> dict:
    """Speculative decoding of the stored pair on `prompts` (reference, FP8 simulated): greedy
    (verify None), or sampled at SAMPLED (seed = the prompt's index) with `verify` "token" or
    "block". Acceptance per draft position, the mean accepted length, and (greedy) how many
    continuations end in a loop."""
    model = reference_model(cfg, tensors, prec)
    if verify is None:
        params = [SamplingParams(max_new_tokens=new) for _ in prompts]
    else:
        params = [SamplingParams(max_new_tokens=new, seed=i, verify=verify, **SAMPLED)
                  for i in range(len(prompts))]
    t0 = time.perf_counter()
    res = generate(model, prompts, params, speculative=True)
    out = {"acceptance_per_position": [round(a, 4) for a in res.acceptance_per_position],
           "mean_accepted_length": round(res.mean_accepted_length, 4),
           "row_steps": res.row_steps, "prompts": len(prompts), "new_tokens": new}
    if verify is None:
        out["ending_in_a_loop"] = sum(ends_in_loop(t) for t in res.tokens)
    else:
        out["sampling"] = dict(SAMPLED, verify=verify)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def acceptance_reports(cfg: ModelConfig, tensors: dict, prompts: list[list[int]], new: int,
                       prec: Precision | None = None) -> dict:
    """measure_acceptance greedy and sampled with each verification, under report keys."""
    return {"greedy": measure_acceptance(cfg, tensors, prompts, new, prec),
            "sampled_token": measure_acceptance(cfg, tensors, prompts, new, prec, "token"),
            "sampled_block": measure_acceptance(cfg, tensors, prompts, new, prec, "block")}


def ci_check(cfg: ModelConfig, tensors: dict, held: torch.Tensor, tc) -> dict:
    """The acceptance the CI re-measures: float64 activations (FP8 simulation kept) on the
    first ci_prompts held-out prompts. fp64 leaves no near-tie a BLAS or thread count can flip
    (tests/models/test_train.py)."""
    tc = tc if isinstance(tc, dict) else asdict(tc)
    prompts = spaced_windows(held, tc["eval_prompts"], tc["prompt_len"])[:tc["ci_prompts"]]
    rep = acceptance_reports(cfg, tensors, prompts.tolist(), tc["ci_new_tokens"],
                             Precision(torch.float64))
    return {k: {f: v[f] for f in ("acceptance_per_position", "mean_accepted_length",
                                  "row_steps")} for k, v in rep.items()}


# the fields the target stage depends on: a --target-from checkpoint must match them all
TARGET_FIELDS = ("seed", "threads", "target_steps", "target_batch", "target_seq", "target_lr",
                 "target_warmup")


def _target_report(src: Path, tc: TrainConfig) -> dict:
    """The train_report of a `--target-only` run, checked to hold the target this config would
    train (the same target fields); checked before any work."""
    report_path = src / TRAIN_REPORT_NAME
    if not report_path.is_file():
        raise FileNotFoundError(f"--target-from {src}: no {TRAIN_REPORT_NAME} (not a checkpoint "
                                "this script wrote)")
    try:
        report = json.loads(report_path.read_text())
        theirs = report["train_config"]
        report["target"], report["seconds"]["target"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--target-from {src}: {TRAIN_REPORT_NAME} is not a training report "
                         f"({type(e).__name__}: {e})") from None
    diff = [f"{k}={theirs.get(k)!r} (here {getattr(tc, k)!r})" for k in TARGET_FIELDS
            if theirs.get(k) != getattr(tc, k)]
    if diff:
        raise ValueError(f"--target-from {src}: its target was trained with "
                         f"{', '.join(diff)}")
    return report


def _target_tensors(src: Path, tokenizer_text: str, cfg: ModelConfig) -> dict:
    """The stored checkpoint of that run (its draft untrained), its tokenizer checked to be the
    one this corpus trains."""
    from dspark_compile.models.checkpoint import load_checkpoint
    tok_path = src / TOKENIZER_NAME
    if not tok_path.is_file() or tok_path.read_text() != tokenizer_text:
        raise ValueError(f"--target-from {src}: its {TOKENIZER_NAME} is missing or differs from "
                         "the one this corpus trains")
    return load_checkpoint(src, cfg)[1]


def train_tiny(out_dir: str | Path, tc: TrainConfig = TrainConfig(), overwrite: bool = False,
               corpus: Corpus | None = None, stream_out=None, target_only: bool = False,
               target_from: str | Path | None = None) -> dict:
    """Run the whole pipeline (module docstring) and write the checkpoint to `out_dir`
    (config.json, model.safetensors, tokenizer.json, train_report.json). Returns the report.

    `target_only`: stop after the target (the draft left at its initialisation, no acceptance
    measured). `target_from`: take the target of such a run instead of training it; the result
    is the same as one run (each stage has its own generator), only split in two processes."""
    out = Path(out_dir)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output directory {out} exists and is not empty (pass "
                              "--overwrite to replace it)")
    if target_only and target_from is not None:
        raise ValueError("--target-only and --target-from exclude each other")
    if tc.label_rows not in ("greedy", "all"):
        raise ValueError(f"train: label_rows must be 'greedy' or 'all', got {tc.label_rows!r}")
    prior = None if target_from is None else _target_report(Path(target_from), tc)
    threads = torch.get_num_threads()
    torch.set_num_threads(tc.threads)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    try:
        raw = preset(PRESET)
        cfg = ModelConfig.from_dict(raw)
        corpus = corpus or Corpus.stdlib()
        torch.manual_seed(tc.seed)
        t0 = time.perf_counter()
        train_texts = Corpus.read(corpus.train)
        tok = train_bpe(train_texts, cfg)
        tok_text = tok.to_str(pretty=True) + "\n"
        stream = encode_stream(tok, train_texts, cfg.eos_token_id)
        held = encode_stream(tok, Corpus.read(corpus.held_out), cfg.eos_token_id)
        t_tok = time.perf_counter() - t0

        rope = Rope(cfg, MAX_POSITIONS)
        P = TrainParams(cfg, synth_tensors(cfg, tc.seed), fake_quant=tc.fake_quant)
        if target_from is None:
            target = train_target(P, stream, tc, rope,
                                  torch.Generator().manual_seed(2 * tc.seed), stream_out)
            stored = P.to_checkpoint()      # the target as stored; the draft still its init
            target_cpu = None
        else:
            stored = _target_tensors(Path(target_from), tok_text, cfg)
            target = dict(prior["target"], seconds=prior["seconds"]["target"])
            target_cpu = prior["seconds"].get("cpu_total")
        S = TrainParams(cfg, {n: t for n, t in stored.items() if not n.startswith("mtp.")})
        target["held_out_loss"] = round(held_out_loss(S, held, tc.held_out_windows,
                                                      tc.target_seq, rope), 4)
        seconds = {"tokenizer": round(t_tok, 2), "target": round(target.pop("seconds"), 2)}
        report = {
            "train_config": asdict(tc),
            "corpus": {"train_files": len(corpus.train), "held_out_files": len(corpus.held_out),
                       "train_tokens": stream.numel(), "held_out_tokens": held.numel(),
                       "held_out": [p.name for p in corpus.held_out]},
            "seconds": seconds,
            "target": target,
        }
        if target_only:
            tensors = dict(stored)
        else:
            tensors, draft_report = train_draft_stage(S, stored, cfg, stream, held, tc, rope,
                                                      seconds, stream_out)
            report.update(draft_report)
            if target_from is not None:
                report["target_from"] = {"cpu_total": target_cpu}
        seconds["total"] = round(time.perf_counter() - t_start, 2)
        # CPU seconds of this process: what the wall time is on an idle machine (one thread),
        # whatever else shares the cores
        seconds["cpu_total"] = round(time.process_time() - cpu_start, 2)
        report["torch"] = torch.__version__
        write_checkpoint(raw, tensors, out, overwrite=overwrite,
                         files={TOKENIZER_NAME: tok_text,
                                TRAIN_REPORT_NAME: json.dumps(report, indent=1) + "\n"})
        return report
    finally:
        torch.set_num_threads(threads)


def train_draft_stage(S: TrainParams, stored: dict, cfg: ModelConfig, stream: torch.Tensor,
                      held: torch.Tensor, tc: TrainConfig, rope: Rope, seconds: dict,
                      stream_out=None) -> tuple[dict, dict]:
    """Stages 4-6: the draft's data, the draft, the measurement. Returns (the pair's tensors,
    the report's draft entries). The draft trains from the stored checkpoint (its untrained
    draft, the target's embedding and head as the engine reads them)."""
    P = TrainParams(cfg, stored, fake_quant=tc.fake_quant)
    gen = torch.Generator().manual_seed(2 * tc.seed + 1)
    n_greedy, n_sampled = tc.continuations, tc.sampled_continuations
    prompts = windows(stream, n_greedy + n_sampled, tc.prompt_len, gen)
    t0 = time.perf_counter()
    new = tc.continuation_len
    seqs = [continuations(cfg, stored, prompts[:n_greedy], new, stream_out=stream_out)]
    if n_sampled:
        sp = [SamplingParams(max_new_tokens=new, seed=tc.seed * 1_000_000 + i,
                             temperature=tc.teacher_temperature, top_p=tc.teacher_top_p)
              for i in range(n_sampled)]
        seqs.append(continuations(cfg, stored, prompts[n_greedy:], new, sp, stream_out,
                                  "sample"))
    seqs = torch.cat(seqs)
    seconds["continuations"] = round(time.perf_counter() - t0, 2)
    aux, probs = target_teacher(S, seqs, rope, tc)
    draft = train_draft(P, seqs, aux, probs, tc, rope, gen, stream_out)
    seconds["draft"] = round(draft.pop("seconds"), 2)
    tensors = P.to_checkpoint()
    tensors.update({n: t for n, t in stored.items() if not n.startswith("mtp.")})
    t0 = time.perf_counter()
    eval_prompts = spaced_windows(held, tc.eval_prompts, tc.prompt_len).tolist()
    acc = acceptance_reports(cfg, tensors, eval_prompts, tc.eval_new_tokens)
    ci = ci_check(cfg, tensors, held, tc)
    seconds["measurement"] = round(time.perf_counter() - t0, 2)
    return tensors, {"draft": draft, "held_out_greedy": acc["greedy"],
                     "held_out_sampled_token": acc["sampled_token"],
                     "held_out_sampled_block": acc["sampled_block"], "ci_float64": ci}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_compile.factory.train",
                                 description="train the tiny target and its DSpark draft")
    ap.add_argument("--out", required=True, help="checkpoint directory to write (atomically)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1)")
    ap.add_argument("--small", action="store_true", help="the CI's reduced run (seconds)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint")
    ap.add_argument("--target-only", action="store_true",
                    help="stop after the target (the draft untrained): a first half to resume "
                         "with --target-from")
    ap.add_argument("--target-from", metavar="DIR", default=None,
                    help="take the target of a --target-only run with the same config and seed "
                         "instead of training it")
    args = ap.parse_args(argv)
    tc = TrainConfig.small(args.seed) if args.small else TrainConfig(seed=args.seed)
    if args.threads is not None:
        if args.threads < 1:
            print(f"error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        tc = replace(tc, threads=args.threads)
    try:
        report = train_tiny(args.out, tc, overwrite=args.overwrite,
                            target_only=args.target_only, target_from=args.target_from)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.target_only:
        t = report["target"]
        print(f"wrote {args.out}: target only, training loss {t['loss_last20']:.3f}, held-out "
              f"loss {t['held_out_loss']:.3f} nats/token; {report['seconds']['total']:.0f}s")
        return 0
    t = report["target"]
    lines = [f"wrote {args.out}: training loss {t['loss_last20']:.3f}, held-out loss "
             f"{t['held_out_loss']:.3f} nats/token; {report['seconds']['total']:.0f}s "
             f"({report['seconds']['cpu_total']:.0f} CPU s)"]
    for key in ("held_out_greedy", "held_out_sampled_token", "held_out_sampled_block"):
        acc = report[key]
        lines.append(f"  {key}: acceptance per position "
                     f"{' '.join(f'{a:.3f}' for a in acc['acceptance_per_position'])}, mean "
                     f"accepted length {acc['mean_accepted_length']:.3f} ({acc['row_steps']} "
                     "row-steps)" + (f", {acc['ending_in_a_loop']} of {acc['prompts']} ending "
                                     "in a loop" if "ending_in_a_loop" in acc else ""))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
