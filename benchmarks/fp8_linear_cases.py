"""fp8_linear benchmark cases (groups "fp8_linear" and "fp8_linear_multi"), Flash shapes.

    python benchmarks/kernel_bench.py --only fp8_linear --out benchmarks/results/h200_fp8_linear
    python benchmarks/kernel_bench.py --only fp8_linear --variants 'ours*' --batches 1
    python benchmarks/kernel_bench.py --only fp8_linear_multi --variants 'ours*,separate*'

Cases: every distinct (N, K, groups) of the Flash FP8 linears (kernels/fp8_linear.py's table;
wo_a is its 8 groups of 1024 x 4096) at M = 1 and M = 6B for B in --batches (the default
1,4,16,64 gives M = 1, 6, 24, 96, 384). Inputs are what the step feeds the op: fp8 activations
with fp32 UE8M0 scales per 128 (act_quant of random bf16 rows), random e4m3 weight bytes with
E8M0 block scales 2^-9..2^-5.

Variants: `eager` (the reference: dequantize both operands to fp32, fp32 GEMM: what the step
ran before the kernel), `ours` (dspark::fp8_linear), `ours-split1` (its plan without split-K),
`ours-two-launch` (its plan with the split-K partials summed by a second launch,
`fold_splitk=False`: the launcher before the fold; only where the plan splits K),
`bf16-cublas` (the bf16 GEMM of a weight dequantized once, before timing: what a bf16 model
would cost, 2 bytes per weight), `scaled-mm` (torch._scaled_mm with 1x128 activation and
128 x 128 weight scales, the groups as a loop; only where a probe call works on this GPU).

bytes_moved (the weight-byte floor the targets compare with): N*K weight bytes + N*K/16384
scale bytes + M*K*G activation bytes + M*K*G/32 scale bytes (fp32 per 128) + M*N*2 (bf16 out).

Group "fp8_linear_multi": the sets passes/group_fp8_linears.py merges (MULTI_SETS: wq_a + wkv,
wq_b + the indexer's wq_b, shared w1 + w3) at T = 6B for B in --batches (6, 24, 96, 384 by
default). Variants: `ours` (dspark::fp8_linear_multi, one launch), `separate` (one
dspark::fp8_linear per weight: the step before the pass), `separate-two-launch` (the same with
the split-K sum as a second launch: the step before both changes); the check asks `ours` to
equal `separate` bit for bit. bytes_moved: every weight and scale once, x and its scales once,
every output once.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from harness import Case, compare

from dspark_compile.kernels import fp8_linear as fl
from dspark_compile.kernels import fp8_linear_multi as fm
from dspark_compile.kernels.act_quant import act_quant_reference

# (N, K, groups) -> the linears with that shape
SHAPES = {(1024, 4096, 1): "wq_a", (32768, 1024, 1): "wq_b", (512, 4096, 1): "wkv",
          (8192, 1024, 1): "indexer.wq_b", (8192, 4096, 8): "wo_a", (4096, 8192, 1): "wo_b",
          (2048, 4096, 1): "shared.w1/w3", (4096, 2048, 1): "shared.w2",
          (4096, 12288, 1): "draft.main_proj"}
TOKENS_PER_REQUEST = 6


def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def floor_bytes(M, N, K, G) -> int:
    return N * K + -(-N // 128) * (K // 128) + M * K * G * (1 + 4 / 128) + M * N * 2


def _make(M, N, K, G):
    def make(device, seed):
        g = _gen(device, seed)
        x = (torch.randn(M, G * K, generator=g, device=device) * 2).to(torch.bfloat16)
        xq, xs = act_quant_reference(x)
        # e4m3 bytes without the NaN codes 0x7F / 0xFF (magnitude codes 0..126, random sign)
        wb = torch.randint(0, 127, (N, K), dtype=torch.uint8, generator=g, device=device)
        wb |= torch.randint(0, 2, (N, K), dtype=torch.uint8, generator=g, device=device) << 7
        ws = torch.randint(118, 123, (-(-N // 128), K // 128), dtype=torch.uint8, generator=g,
                           device=device)
        return {"x": xq, "x_s": xs, "w": wb.view(torch.float8_e4m3fn), "w_s": ws, "groups": G}
    return make


def _reference(d):
    return fl.fp8_linear_reference(d["x"], d["x_s"], d["w"], d["w_s"], d["groups"],
                                   torch.bfloat16)


def _ours(d):
    return torch.ops.dspark.fp8_linear(d["x"], d["x_s"], d["w"], d["w_s"], d["groups"],
                                       torch.bfloat16)


def _ours_split1(d):
    M, N, K = d["x"].shape[0], d["w"].shape[0], d["w"].shape[1]
    p = fl.fp8_linear_plan(M, N, K, d["groups"])
    p = dataclasses.replace(p, split_k=1, kb_per_split=K // 128)
    return fl.fp8_linear_launch(d["x"], d["x_s"], d["w"], d["w_s"], d["groups"],
                                torch.bfloat16, plan=p)


def _two_launch_plan(d):
    M, N, K = d["x"].shape[0], d["w"].shape[0], d["w"].shape[1]
    return dataclasses.replace(fl.fp8_linear_plan(M, N, K, d["groups"]), fold_splitk=False)


def _ours_two_launch(d):
    return fl.fp8_linear_launch(d["x"], d["x_s"], d["w"], d["w_s"], d["groups"],
                                torch.bfloat16, plan=_two_launch_plan(d))


def _bf16_cublas(d):
    """x and W dequantized to bf16 on the first call (outside the timed graphs), then bf16 GEMMs:
    one per group, as the grouped einsum's batched GEMM would run."""
    if "_bf16" not in d:
        G = d["groups"]
        xd = (d["x"].float().unflatten(-1, (-1, 128)) * d["x_s"][..., None]).flatten(-2)
        wd = fl.block_dequant(d["w"], d["w_s"], torch.bfloat16)
        d["_bf16"] = (xd.to(torch.bfloat16).view(xd.shape[0], G, -1).transpose(0, 1),
                      wd.view(G, wd.shape[0] // G, -1))
    a, w = d["_bf16"]
    return torch.bmm(a, w.transpose(1, 2))


def _scaled_mm_args(d):
    """fp8 operands and fp32 scales in the layouts _scaled_mm's blockwise path takes: per group
    a [M, K] row-major with scale (M, K/128) outer-dim-major, W^T [K, N/G] column-major with
    scale (K/128, N/G/128)."""
    if "_smm" not in d:
        G, K = d["groups"], d["w"].shape[1]
        ng = d["w"].shape[0] // G
        ws = torch.exp2(d["w_s"].float() - 127.0)
        d["_smm"] = [(d["x"][:, g * K:(g + 1) * K],
                      d["x_s"][:, g * K // 128:(g + 1) * K // 128].t().contiguous().t(),
                      d["w"][g * ng:(g + 1) * ng].t(),
                      ws[g * ng // 128:(g + 1) * ng // 128].t())
                     for g in range(G)]
    return d["_smm"]


def _scaled_mm(d):
    outs = [torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            for a, sa, b, sb in _scaled_mm_args(d)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


@functools.lru_cache(maxsize=None)
def _scaled_mm_works(M, N, K, G) -> bool:
    """One call on this GPU at the case's shape; blockwise scaling needs sm_90+ and a recent
    CUDA, and a failing variant would stop the run."""
    if not torch.cuda.is_available():
        return False
    try:
        d = _make(M, N, K, G)("cuda", 0)
        return not compare("scaled-mm", _scaled_mm(d), _reference(d))
    except Exception:  # noqa: BLE001 -- any failure: the variant is left out
        return False


def _check(make):
    def check(device):
        a, b = make(device, 123), make(device, 123)
        return compare("y", _ours(a), _reference(b))
    return check


def cases(batches):
    out = []
    for M in sorted({1, *(TOKENS_PER_REQUEST * B for B in batches)}):
        for (N, K, G), use in SHAPES.items():
            make = _make(M, N, K, G)
            extra = {"ours-split1": _ours_split1, "bf16-cublas": _bf16_cublas}
            if _scaled_mm_works(M, N, K, G):
                extra["scaled-mm"] = _scaled_mm
            p = fl.fp8_linear_plan(M, N, K, G)
            if p.split_k > 1:
                extra["ours-two-launch"] = _ours_two_launch
            tile = f"{p.block_m}x{p.block_n}{'-swap' if p.swap_ab else ''}/split{p.split_k}"
            # B = M / 6 (requests at 6 verify rows each; M = 1 plots at B = 1/6)
            params = {"B": M / TOKENS_PER_REQUEST, "T": M, "N": N, "K": K, "groups": G,
                      "use": use, "plan": tile}
            out.append(Case("fp8_linear", f"fp8_linear.{use}", params, make, _reference, _ours,
                            int(floor_bytes(M, N, K, G)), check=_check(make), extra=extra,
                            compile=False))
    return out + multi_cases(batches)


# ------------------------------------------------------------------------------------------------
# group "fp8_linear_multi": the linears of one activation in one launch
# ------------------------------------------------------------------------------------------------

# name -> (K, N of each weight): the sets passes/group_fp8_linears.py merges at Flash shapes
MULTI_SETS = {"wq_a+wkv": (4096, (1024, 512)), "wq_b+indexer.wq_b": (1024, (32768, 8192)),
              "shared.w1+w3": (4096, (2048, 2048))}


def multi_floor_bytes(M, K, Ns) -> int:
    return sum(N * K + -(-N // 128) * (K // 128) + M * N * 2 for N in Ns) + M * K * (1 + 4 / 128)


def _make_multi(M, K, Ns):
    def make(device, seed):
        d = {"ws": [], "w_ss": []}
        for j, N in enumerate(Ns):
            one = _make(M, N, K, 1)(device, seed * 8 + j)
            d["ws"].append(one["w"])
            d["w_ss"].append(one["w_s"])
            if j == 0:
                d["x"], d["x_s"] = one["x"], one["x_s"]
        return d
    return make


def _multi_reference(d):
    return fm.fp8_linear_multi_reference(d["x"], d["x_s"], d["ws"], d["w_ss"], torch.bfloat16)


def _multi_ours(d):
    return fm.fp8_linear_multi_list(d["x"], d["x_s"], d["ws"], d["w_ss"], torch.bfloat16)


def _multi_separate(d):
    return [torch.ops.dspark.fp8_linear(d["x"], d["x_s"], w, s, 1, torch.bfloat16)
            for w, s in zip(d["ws"], d["w_ss"])]


def _multi_separate_two_launch(d):
    out = []
    for w, s in zip(d["ws"], d["w_ss"]):
        one = {"x": d["x"], "x_s": d["x_s"], "w": w, "w_s": s, "groups": 1}
        out.append(_ours_two_launch(one))
    return out


def _multi_check(make):
    def check(device):
        a, b, c = make(device, 123), make(device, 123), make(device, 123)
        ours, refs, sep = _multi_ours(a), _multi_reference(b), _multi_separate(c)
        msgs = [compare(f"y{j}", y, r) for j, (y, r) in enumerate(zip(ours, refs))]
        msgs += [compare(f"y{j} vs separate", y, z, exact=True)
                 for j, (y, z) in enumerate(zip(ours, sep))]
        return "; ".join(m for m in msgs if m)
    return check


def multi_cases(batches):
    out = []
    for M in sorted({TOKENS_PER_REQUEST * B for B in batches}):
        for use, (K, Ns) in MULTI_SETS.items():
            make = _make_multi(M, K, Ns)
            plans = [fl.fp8_linear_plan(M, N, K) for N in Ns]
            tile = f"{plans[0].block_m}x{plans[0].block_n}/split" + \
                "+".join(str(p.split_k) for p in plans)
            params = {"B": M / TOKENS_PER_REQUEST, "T": M, "N": "+".join(map(str, Ns)), "K": K,
                      "use": use, "plan": tile}
            out.append(Case("fp8_linear_multi", f"fp8_linear_multi.{use}", params, make,
                            _multi_reference, _multi_ours, int(multi_floor_bytes(M, K, Ns)),
                            check=_multi_check(make),
                            extra={"separate": _multi_separate,
                                   "separate-two-launch": _multi_separate_two_launch},
                            compile=False))
    return out
