"""Which op first makes a verify-sized chunk differ from one-token decode? An eager probe.

The lossless check compares the engine's speculative step (the target runs N + 1 tokens a row)
with its target-only step (1 token a row). Every op whose value for a token depends on how many
tokens or rows share its call breaks that to the bit. This probe runs the eager model on one
device twice over the same prompt -- in chunks of `--chunk` tokens on one state row, and one
token at a time on another -- recording every op's outputs (aten and `dspark::`) through a
dispatch mode. The references the fusion passes replace run as their `dspark::` ops
(kernels/region.py fused_eager), so on a GPU the probe sees the engine's kernels and the aten
glue between them; `--references` runs the plain references instead. Call k of the chunked run is aligned with the one-token calls of its tokens; an
output's token dimension is the one that is `chunk` there and 1 in the one-token run. It
reports, in execution order, the first ops whose token slices differ in any bit.

    python benchmarks/invariance_probe.py CKPT --device cuda --dtype bfloat16 --tokens 48

On the CPU the references are invariant: the probe then reports no op. Tuning data only:
nothing here is imported by the product.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

from dspark_compile.kernels.region import fused_eager  # noqa: E402
from dspark_compile.models import load_model  # noqa: E402
from dspark_compile.models.batch import Batch  # noqa: E402
from dspark_compile.models.config import CacheConfig, Precision  # noqa: E402
from dspark_compile.models.state import allocate_state  # noqa: E402


class Recorder(TorchDispatchMode):
    """Every non-mutating op's tensor outputs, in call order (in-place ops write the state,
    whose contents differ in time between the two runs, and are skipped)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable:
            self.calls.append((str(func), [o.detach().clone() for o in tree_leaves(out)
                                           if isinstance(o, torch.Tensor)]))
        return out


def record(model, state, rows: list[int], ids: torch.Tensor, chunk: int) -> list[list]:
    """Per forward call (`rows` fed ids [len(rows), L] together, `chunk` tokens a call): its
    recorded ops."""
    per_call = []
    trash = state["row.last_pos"].shape[0] - 1
    dev = state["row.last_pos"].device
    R = torch.tensor(rows, device=dev)
    for s in range(0, ids.shape[1], chunk):
        e = min(s + chunk, ids.shape[1])
        pos = torch.arange(s, e, device=dev)[None].repeat(len(rows), 1)
        b = Batch.make(R, pos, ids[:, s:e], trash, model.cfg.vocab_size)
        with Recorder() as rec:
            model(b, state)
        per_call.append(rec.calls)
    return per_call


def _slice(big: torch.Tensor, one: torch.Size, n_rows: int, which: int, chunk: int):
    """Request `which`'s tokens of a batched output, shaped to concatenate the one-token run's
    along its token dim: (slice, dim), or None where no dim is unambiguously the tokens. The
    tokens are one flat dim of n_rows * chunk, or a (rows, tokens) pair of dims."""
    shape = big.shape
    if len(shape) != len(one):
        return None
    rest = lambda ds: all(shape[i] == one[i] for i in range(len(shape)) if i not in ds)  # noqa: E731
    flat = [d for d in range(len(shape)) if shape[d] == n_rows * chunk and one[d] == 1 and rest((d,))]
    pair = [d for d in range(len(shape) - 1) if n_rows > 1 and shape[d] == n_rows
            and shape[d + 1] == chunk and one[d] == one[d + 1] == 1 and rest((d, d + 1))]
    if len(flat) + len(pair) != 1:
        return None
    if flat:
        return big.narrow(flat[0], which * chunk, chunk), flat[0]
    return big.narrow(pair[0], which, 1), pair[0] + 1


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: NaNs compare equal to themselves, -0 differs from 0."""
    t = t.contiguous()
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.dtype.is_floating_point else t


def compare(chunked: list[list], single: list[list], chunk: int, limit: int,
            n_rows: int = 1, which: int = 0) -> dict:
    """The first `limit` ops (by call order within a chunk) whose slices for request `which`
    (of `n_rows` fed together) differ from that request decoded alone."""
    found, checked, unaligned = [], 0, 0
    for k, calls in enumerate(chunked):
        ones = single[k * chunk:(k + 1) * chunk]
        if len(ones) != chunk or any(len(o) != len(calls) for o in ones):
            unaligned += 1
            continue
        for i, (name, outs) in enumerate(calls):
            if any(o[i][0] != name for o in ones):
                unaligned += 1
                break
            for j, big in enumerate(outs):
                parts = [o[i][1][j] for o in ones]
                cut = _slice(big, parts[0].shape, n_rows, which, chunk)
                if cut is None:
                    continue
                got, d = cut
                checked += 1
                ref = torch.cat(parts, d)
                same = torch.equal(_bits(got), _bits(ref))
                if not same and len(found) < limit:
                    diff = float((got.double() - ref.double()).abs().nan_to_num(0).max()) \
                        if got.dtype.is_floating_point else 0.0
                    found.append({"chunk_call": k, "op_index": i, "op": name, "output": j,
                                  "shape": list(big.shape), "max_abs_diff": diff})
    return {"differing": found, "outputs_checked": checked, "unaligned_calls": unaligned}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--no-fp8-sim", action="store_true", help="Precision.exact (no FP8 rounding)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--chunk", type=int, default=6)
    p.add_argument("--rows", type=int, default=1,
                   help="requests fed together in the chunked run; the middle one is compared")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--references", action="store_true",
                   help="run the references, not the dspark:: ops the passes put in their place")
    p.add_argument("--out", help="write the report as JSON here as well")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    prec = Precision.exact(dtype) if args.no_fp8_sim else Precision(dtype=dtype)
    model = load_model(args.ckpt, prec, max_positions=4 * args.tokens + 64, with_draft=False,
                       device=args.device)
    cache = CacheConfig(max_rows=args.rows, max_seq_len=args.tokens + 8, max_step_tokens=max(args.chunk, 8))
    # one state per run, both on row 0: the slot indices are then equal in both runs too
    states = [allocate_state(model.cfg, cache, prec, device=args.device) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (args.rows, args.tokens), generator=g).to(args.device)
    which = args.rows // 2
    with torch.no_grad(), (contextlib.nullcontext() if args.references else fused_eager()):
        chunked = record(model, states[0], list(range(args.rows)), ids, args.chunk)
        single = record(model, states[1], [which], ids[which:which + 1], 1)
    rep = {"device": args.device, "dtype": args.dtype, "fp8_sim": not args.no_fp8_sim,
           "tokens": args.tokens, "chunk": args.chunk, "rows": args.rows,
           **compare(chunked, single, args.chunk, args.limit, args.rows, which)}
    for f in rep["differing"]:
        print(f"chunk call {f['chunk_call']} op {f['op_index']:5d} {f['op']:40s} {f['shape']} "
              f"max |diff| {f['max_abs_diff']:.3g}")
    print(f"{len(rep['differing'])} differing (limit {args.limit}) of {rep['outputs_checked']} "
          f"outputs checked; unaligned calls {rep['unaligned_calls']}")
    if args.out:
        bench_args.write_record(Path(args.out), rep)


if __name__ == "__main__":
    main()
