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
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dspark_compile.kernels.region import fused_eager
from dspark_compile.models import load_model
from dspark_compile.models.batch import Batch
from dspark_compile.models.config import CacheConfig, Precision
from dspark_compile.models.state import allocate_state


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


def record(model, state, row: int, ids: torch.Tensor, chunk: int) -> list[list]:
    """Per forward call: its recorded ops."""
    per_call = []
    trash = state["row.last_pos"].shape[0] - 1
    dev = state["row.last_pos"].device
    for s in range(0, len(ids), chunk):
        e = min(s + chunk, len(ids))
        b = Batch.make(torch.tensor([row], device=dev), torch.arange(s, e, device=dev)[None],
                       ids[None, s:e], trash, model.cfg.vocab_size)
        with Recorder() as rec:
            model(b, state)
        per_call.append(rec.calls)
    return per_call


def _token_dim(big: torch.Size, one: torch.Size, chunk: int):
    if len(big) != len(one):
        return None
    dims = [d for d in range(len(big)) if big[d] == chunk and one[d] == 1
            and all(big[i] == one[i] for i in range(len(big)) if i != d)]
    return dims[0] if len(dims) == 1 else None


def compare(chunked: list[list], single: list[list], chunk: int, limit: int) -> dict:
    """The first `limit` ops (by call order within a chunk) whose token slices differ."""
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
                d = _token_dim(big.shape, parts[0].shape, chunk)
                if d is None:
                    continue
                checked += 1
                ref = torch.cat(parts, d)
                if big.dtype.is_floating_point:
                    same = torch.equal(big.view(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)) \
                        if big.is_contiguous() and ref.is_contiguous() else torch.equal(big, ref)
                    diff = float((big.double() - ref.double()).abs().max()) if not same else 0.0
                else:
                    same, diff = torch.equal(big, ref), 0.0
                if not same and len(found) < limit:
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
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--references", action="store_true",
                   help="run the references, not the dspark:: ops the passes put in their place")
    p.add_argument("--out", help="write the report as JSON here as well")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    prec = Precision.exact(dtype) if args.no_fp8_sim else Precision(dtype=dtype)
    model = load_model(args.ckpt, prec, max_positions=4 * args.tokens + 64, with_draft=False,
                       device=args.device)
    cache = CacheConfig(max_rows=1, max_seq_len=args.tokens + 8, max_step_tokens=max(args.chunk, 8))
    # one state per run, both on row 0: the slot indices are then equal in both runs too
    states = [allocate_state(model.cfg, cache, prec, device=args.device) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (args.tokens,), generator=g).to(args.device)
    with torch.no_grad(), (contextlib.nullcontext() if args.references else fused_eager()):
        chunked = record(model, states[0], 0, ids, args.chunk)
        single = record(model, states[1], 0, ids, 1)
    rep = {"device": args.device, "dtype": args.dtype, "fp8_sim": not args.no_fp8_sim,
           "tokens": args.tokens, "chunk": args.chunk, **compare(chunked, single, args.chunk, args.limit)}
    for f in rep["differing"]:
        print(f"chunk call {f['chunk_call']} op {f['op_index']:5d} {f['op']:40s} {f['shape']} "
              f"max |diff| {f['max_abs_diff']:.3g}")
    print(f"{len(rep['differing'])} differing (limit {args.limit}) of {rep['outputs_checked']} "
          f"outputs checked; unaligned calls {rep['unaligned_calls']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
