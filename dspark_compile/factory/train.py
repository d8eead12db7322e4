"""Train the tiny DeepSeek-V4 target and its DSpark draft, so acceptance is a real number.

    python -m dspark_compile.factory.train --out DIR [--seed 0] [--threads 2] [--small]

The pipeline (each stage deterministic for the seed at a fixed thread count):

1. corpus: the standard library's top-level modules, those starting with f, g or h held out
   (dspark_compile/factory/train_data.py);
2. tokenizer: a byte-level BPE of the model's vocabulary on the training files
   (dspark_compile/factory/tokenizer.py);
3. target: the `tiny-trained` shapes (every layer type of `tiny`), initialised as `synth`
   does, trained on next-token cross-entropy in fp32 (dspark_compile/factory/train_model.py), then stored in
   its formats (FP8 block-scaled linears, MXFP4 experts, bf16 tables);
4. draft data: the *stored* target (the reference model with FP8 activation and KV
   simulation, as the engine runs it) continues training-corpus prompts greedily: the draft
   learns what the target will actually say;
5. draft: DSpark's recipe -- blocks of [anchor, noise x (N - 1)] after random committed
   positions of those continuations, conditioned on the target's hidden states (the stored
   target's, recomputed in fp32), the Markov head fed the previous target token, cross-entropy
   against the target's tokens with weight decay^k at draft position k (the first drafts
   decide most of the accepted length); the target's embedding and LM head are shared and
   frozen;
6. measurement: greedy speculative decoding of the stored pair (the reference eager loop with
   FP8 simulation) on prompts from the held-out files: acceptance per draft position and the
   mean accepted length, written to train_report.json with the losses and timings.

The committed checkpoint dspark_compile/factory/data/tiny-trained is this script's output for TrainConfig();
`synth --preset tiny-trained` copies it (dspark_compile/factory/committed.py).
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
    # target: next-token prediction on corpus windows
    target_steps: int = 200
    target_batch: int = 8
    target_seq: int = 64
    target_lr: float = 3e-3
    # draft data: the stored target's greedy continuations of training-corpus prompts
    continuations: int = 128
    prompt_len: int = 32
    continuation_len: int = 64
    # draft
    draft_steps: int = 200
    draft_batch: int = 8        # continuations per step
    anchors: int = 16           # blocks per continuation per step
    draft_lr: float = 3e-3
    position_decay: float = 0.7  # loss weight of draft position k: position_decay ** k
    fake_quant: bool = False    # train through the stored formats (straight-through; ~3x slower)
    warmup: int = 20            # linear warm-up steps of both schedules (then cosine to 10 %)
    # measurement: held-out prompts
    eval_prompts: int = 16
    eval_new_tokens: int = 48

    @classmethod
    def small(cls, seed: int = 0) -> "TrainConfig":
        """Seconds, not minutes: the CI's check that the script runs end to end."""
        return cls(seed=seed, threads=1, target_steps=3, target_batch=2, target_seq=32,
                   continuations=2, prompt_len=8, continuation_len=10, draft_steps=3,
                   draft_batch=2, anchors=4, warmup=1, eval_prompts=2, eval_new_tokens=6)


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
    losses = []
    for step in range(tc.target_steps):
        seq = windows(stream, tc.target_batch, tc.target_seq + 1, gen)
        logits = target_forward(P, seq[:, :-1], rope)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))
        _step(opt, params, loss, _lr(step, tc.target_steps, tc.target_lr, tc.warmup))
        losses.append(float(loss.detach()))
        bar.update(step + 1, f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    seconds = bar.close(f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return {"seconds": seconds, "loss_first": losses[0], "loss_last20": sum(losses[-20:]) / len(losses[-20:])}


def reference_model(cfg: ModelConfig, tensors: dict, prec: Precision | None = None):
    return load_model(None, prec or Precision(torch.float32), MAX_POSITIONS, tensors=tensors,
                      cfg=cfg)


def greedy_continuations(cfg: ModelConfig, tensors: dict, prompts: torch.Tensor, new: int,
                         stream_out=None) -> torch.Tensor:
    """[n, prompt + new]: each prompt and the stored target's greedy continuation (reference
    decoding with FP8 simulation, in batches of 64 rows)."""
    model = reference_model(cfg, tensors)
    bar = Progress("continue", prompts.shape[0], stream_out)
    out = []
    for i in range(0, prompts.shape[0], 64):
        chunk = prompts[i:i + 64].tolist()
        res = generate(model, chunk, [SamplingParams(max_new_tokens=new) for _ in chunk],
                       speculative=False)
        out.extend(p + t for p, t in zip(chunk, res.tokens))
        bar.update(len(out))
    bar.close()
    return torch.tensor(out, dtype=torch.int64)


@torch.no_grad()
def target_hidden(P: TrainParams, seqs: torch.Tensor, rope: Rope) -> torch.Tensor:
    return torch.cat([target_forward(P, seqs[i:i + 16], rope, aux=True)[1]
                      for i in range(0, seqs.shape[0], 16)])


def draft_loss(P: TrainParams, aux: torch.Tensor, seqs: torch.Tensor, last: torch.Tensor,
               rope: Rope, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss of the blocks drafted after positions last [B, A] of seqs [B, L]; also the
    per-position top-1 agreement with the target's tokens [N] (teacher-forced)."""
    N = P.cfg.dspark_block_size
    ar = torch.arange(N)
    anchors = seqs.gather(1, last + 1)
    prev = seqs.gather(1, (last[..., None] + 1 + ar).flatten(1)).view(*last.shape, N)
    labels = seqs.gather(1, (last[..., None] + 2 + ar).flatten(1)).view(*last.shape, N)
    logits = draft_forward(P, aux, anchors, last, prev, rope)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.reshape(-1), reduction="none").view_as(labels)
    w = decay ** ar.to(ce.dtype)
    loss = (ce * w).sum(-1).mean() / w.sum()
    agree = (logits.argmax(-1) == labels).float().flatten(0, 1).mean(0)
    return loss, agree


def train_draft(P: TrainParams, seqs: torch.Tensor, aux: torch.Tensor, tc: TrainConfig,
                rope: Rope, gen: torch.Generator, stream_out=None) -> dict:
    cfg = P.cfg
    N = cfg.dspark_block_size
    params = P.group("mtp.")
    opt = _optimizer(params, tc.draft_lr)
    lo, hi = tc.prompt_len - 1, seqs.shape[1] - N - 2   # anchors are the target's own tokens
    if hi < lo:
        raise ValueError(f"train: continuation_len={tc.continuation_len} leaves no draft block "
                         f"(needs >= {N + 2} tokens)")
    bar = Progress("draft", tc.draft_steps, stream_out)
    losses, agree = [], None
    for step in range(tc.draft_steps):
        rows = torch.randint(0, seqs.shape[0], (tc.draft_batch,), generator=gen)
        last = torch.randint(lo, hi + 1, (tc.draft_batch, tc.anchors), generator=gen)
        loss, a = draft_loss(P, aux[rows], seqs[rows], last, rope, tc.position_decay)
        _step(opt, params, loss, _lr(step, tc.draft_steps, tc.draft_lr, tc.warmup))
        losses.append(float(loss.detach()))
        agree = a if agree is None else 0.9 * agree + 0.1 * a
        bar.update(step + 1, f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f} agree "
                   + " ".join(f"{x:.2f}" for x in agree.tolist()))
    seconds = bar.close()
    return {"seconds": seconds, "loss_first": losses[0],
            "loss_last20": sum(losses[-20:]) / len(losses[-20:]),
            "teacher_forced_agreement": [round(x, 4) for x in agree.tolist()]}


def measure_acceptance(cfg: ModelConfig, tensors: dict, prompts: list[list[int]], new: int,
                       prec: Precision | None = None) -> dict:
    """Greedy speculative decoding of the stored pair on `prompts` (reference, FP8 simulated)."""
    model = reference_model(cfg, tensors, prec)
    t0 = time.perf_counter()
    res = generate(model, prompts, [SamplingParams(max_new_tokens=new) for _ in prompts],
                   speculative=True)
    return {"acceptance_per_position": [round(a, 4) for a in res.acceptance_per_position],
            "mean_accepted_length": round(res.mean_accepted_length, 4),
            "row_steps": res.row_steps, "prompts": len(prompts), "new_tokens": new,
            "seconds": round(time.perf_counter() - t0, 2)}


def train_tiny(out_dir: str | Path, tc: TrainConfig = TrainConfig(), overwrite: bool = False,
               corpus: Corpus | None = None, stream_out=None) -> dict:
    """Run the whole pipeline (module docstring) and write the checkpoint to `out_dir`
    (config.json, model.safetensors, tokenizer.json, train_report.json). Returns the report."""
    out = Path(out_dir)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output directory {out} exists and is not empty (pass "
                              "--overwrite to replace it)")
    threads = torch.get_num_threads()
    torch.set_num_threads(tc.threads)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    try:
        raw = preset(PRESET)
        cfg = ModelConfig.from_dict(raw)
        corpus = corpus or Corpus.stdlib()
        gen = torch.Generator().manual_seed(tc.seed)
        torch.manual_seed(tc.seed)
        t0 = time.perf_counter()
        train_texts = Corpus.read(corpus.train)
        tok = train_bpe(train_texts, cfg)
        stream = encode_stream(tok, train_texts, cfg.eos_token_id)
        held = encode_stream(tok, Corpus.read(corpus.held_out), cfg.eos_token_id)
        t_tok = time.perf_counter() - t0

        rope = Rope(cfg, MAX_POSITIONS)
        P = TrainParams(cfg, synth_tensors(cfg, tc.seed), fake_quant=tc.fake_quant)
        target = train_target(P, stream, tc, rope, gen, stream_out)

        stored = P.to_checkpoint()          # the target as stored; the draft still its init
        prompts = windows(stream, tc.continuations, tc.prompt_len, gen)
        t0 = time.perf_counter()
        seqs = greedy_continuations(cfg, stored, prompts, tc.continuation_len, stream_out)
        t_cont = time.perf_counter() - t0
        S = TrainParams(cfg, stored)         # the stored target's weights, exactly
        aux = target_hidden(S, seqs, rope)
        draft = train_draft(P, seqs, aux, tc, rope, gen, stream_out)

        tensors = P.to_checkpoint()
        tensors.update({n: t for n, t in stored.items() if not n.startswith("mtp.")})
        eval_prompts = spaced_windows(held, tc.eval_prompts, tc.prompt_len).tolist()
        acc = measure_acceptance(cfg, tensors, eval_prompts, tc.eval_new_tokens)
        report = {
            "train_config": asdict(tc),
            "corpus": {"train_files": len(corpus.train), "held_out_files": len(corpus.held_out),
                       "train_tokens": stream.numel(), "held_out_tokens": held.numel(),
                       "held_out": [p.name for p in corpus.held_out]},
            "seconds": {"tokenizer": round(t_tok, 2), "target": round(target["seconds"], 2),
                        "continuations": round(t_cont, 2), "draft": round(draft["seconds"], 2),
                        "total": round(time.perf_counter() - t_start, 2),
                        # CPU seconds of this process: what the wall time is on an idle machine
                        # (one thread), whatever else shares the cores
                        "cpu_total": round(time.process_time() - cpu_start, 2)},
            "target": {k: v for k, v in target.items() if k != "seconds"},
            "draft": {k: v for k, v in draft.items() if k != "seconds"},
            "held_out_greedy": acc,
            "torch": torch.__version__,
        }
        write_checkpoint(raw, tensors, out, overwrite=overwrite,
                         files={TOKENIZER_NAME: tok.to_str(pretty=True) + "\n",
                                TRAIN_REPORT_NAME: json.dumps(report, indent=1) + "\n"})
        return report
    finally:
        torch.set_num_threads(threads)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_compile.factory.train",
                                 description="train the tiny target and its DSpark draft")
    ap.add_argument("--out", required=True, help="checkpoint directory to write (atomically)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1)")
    ap.add_argument("--small", action="store_true", help="the CI's reduced run (seconds)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint")
    args = ap.parse_args(argv)
    tc = TrainConfig.small(args.seed) if args.small else TrainConfig(seed=args.seed)
    if args.threads is not None:
        if args.threads < 1:
            print(f"error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        tc = replace(tc, threads=args.threads)
    try:
        report = train_tiny(args.out, tc, overwrite=args.overwrite)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    acc = report["held_out_greedy"]
    print(f"wrote {args.out}: held-out greedy acceptance per position "
          f"{' '.join(f'{a:.3f}' for a in acc['acceptance_per_position'])}, mean accepted length "
          f"{acc['mean_accepted_length']:.3f} ({acc['row_steps']} row-steps); "
          f"{report['seconds']['total']:.0f}s ({report['seconds']['cpu_total']:.0f} CPU s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
