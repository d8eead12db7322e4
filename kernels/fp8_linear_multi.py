"""`dspark::fp8_linear_multi`: 2 to 4 FP8 linears of one activation in one launch.

Several projections of a step read the same quantized activation (x, x_s): attention's wq_a
(1024 x 4096) and wkv (512 x 4096) on the normed hidden state, a C4 layer's wq_b
(32768 x 1024) and its indexer's wq_b (8192 x 1024) on the q latent, the shared expert's w1
and w3 (2048 x 4096 each). At batch 1 these small GEMMs are launch-bound (53 fp8_linear
launches, 359 us of an H200 step), so passes/group_fp8_linears.py puts each such set into one
call of this op.

Numerics: output i is `fp8_linear(x, x_s, ws[i], w_ss[i], 1, out_dtype)` bit for bit. The
reference is exactly that list; the kernel gives every weight the plan it gets alone
(fp8_linear_plan: the tile follows M, the split of K follows the weight's (N, K), so batch
invariance holds per weight), runs the same tile body (fp8_linear._fp8_tile) and folds its
split-K sum the same way (fp8_linear._finish_tile). One grid axis holds every weight's
programs one weight after another, each weight's in fp8_linear's order (M tiles fastest, then
N tiles, then splits); a program decodes (weight, M tile, N tile, split) from its id.

Bytes moved: the sum of the weights' (fp8_linear's table), the activation read once per
weight's tiles as before (L2 serves the repeats), each output written once into its own
contiguous tensor (no concatenated weight, no slicing copies).

The op has fixed slots for 4 weights (the last two optional) and returns 4 tensors, the
unused ones empty [..., 0]: the ONNX domain (dspark_compile/inspection/onnx_domain.py) maps tensor and
optional-tensor arguments and tensor returns, not tensor lists. `fp8_linear_multi_list` is the
list-in, list-out call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_compile.kernels import fp8_linear as fl
from dspark_compile.kernels.fp8_linear import _finish_tile, _fp8_tile
from dspark_compile.kernels.invariance import batch_invariant
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.semaphores import tile_counters
from dspark_compile.kernels.tl_helpers import compile_config, interpreting, launch

MAX_WEIGHTS = 4     # the model's sets have 2; 4 slots leave room without a second schema


def fp8_linear_multi_reference(x, x_s, ws, w_ss, out_dtype) -> list:
    """[fp8_linear_reference(x, x_s, w, s, 1, out_dtype) for each weight]."""
    return [fl.fp8_linear_reference(x, x_s, w, s, 1, out_dtype) for w, s in zip(ws, w_ss)]


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _pick(i, a0, a1, a2, a3, NUM_W: tl.constexpr):
    """a_i for a weight index i < NUM_W (a scalar select per slot; pointers or integers)."""
    r = a0
    if NUM_W > 1:
        r = tl.where(i == 1, a1, r)
    if NUM_W > 2:
        r = tl.where(i == 2, a2, r)
    if NUM_W > 3:
        r = tl.where(i == 3, a3, r)
    return r


@triton.jit
def _fp8_linear_multi_kernel(
        x_ptr, xs_ptr, p_ptr, cnt_ptr, w0, s0, y0, w1, s1, y1, w2, s2, y2, w3, s3, y3,
        N0, N1, N2, N3, SPLIT0, SPLIT1, SPLIT2, SPLIT3, KBS0, KBS1, KBS2, KBS3,
        START1, START2, START3, POFF1, POFF2, POFF3, COFF1, COFF2, COFF3,
        M, K, M_TILES, stride_xm, stride_xsm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, A_FP8: tl.constexpr,
        SWAP_AB: tl.constexpr, NUM_STAGES: tl.constexpr, FP8_MMA: tl.constexpr,
        NUM_W: tl.constexpr, FOLD: tl.constexpr, SOFT: tl.constexpr):
    """Weight i's programs are [START_i, START_{i+1}) of the one grid axis (START0 = 0); its
    split-K partials start POFF_i elements into p, its tile counters COFF_i into cnt."""
    pid = tl.program_id(0)
    i = (pid >= START1).to(tl.int32)
    if NUM_W > 2:
        i += (pid >= START2).to(tl.int32)
    if NUM_W > 3:
        i += (pid >= START3).to(tl.int32)
    N = _pick(i, N0, N1, N2, N3, NUM_W)
    split = _pick(i, SPLIT0, SPLIT1, SPLIT2, SPLIT3, NUM_W)
    local = pid - _pick(i, 0, START1, START2, START3, NUM_W)
    pid_m = local % M_TILES
    rest = local // M_TILES
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_n = rest % n_tiles
    pid_s = rest // n_tiles
    # weights and scales are contiguous [N, K] and [cdiv(N, 128), K / 128] (the launcher checks)
    acc = _fp8_tile(x_ptr, xs_ptr, _pick(i, w0, w1, w2, w3, NUM_W),
                    _pick(i, s0, s1, s2, s3, NUM_W), pid_m, pid_n, pid_s, M, N, K, N,
                    _pick(i, KBS0, KBS1, KBS2, KBS3, NUM_W), stride_xm, stride_xsm, K, K // 128,
                    BLOCK_M, BLOCK_N, A_FP8, SWAP_AB, NUM_STAGES, FP8_MMA, SOFT)
    poff = _pick(i, 0, POFF1, POFF2, POFF3, NUM_W).to(tl.int64)
    coff = _pick(i, 0, COFF1, COFF2, COFF3, NUM_W)
    _finish_tile(acc, _pick(i, y0, y1, y2, y3, NUM_W), p_ptr + poff,
                 cnt_ptr + coff + pid_m + pid_n * M_TILES, pid_m, pid_n, pid_s, M, N, split,
                 N.to(tl.int64) * M, BLOCK_M, BLOCK_N, FOLD, SOFT)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

def _plans(x2, a_fp8, ws, out_dtype, plans):
    """Each weight's plan alone (fp8_linear_plan), or `plans` (tests, benchmarks)."""
    if plans is not None:
        if len(plans) != len(ws):
            raise ValueError(f"plans: one per weight ({len(ws)}), got {len(plans)}")
        return list(plans)
    M, K = x2.shape
    interp = interpreting(_fp8_linear_multi_kernel)
    return [fl.fp8_linear_plan(M, w.shape[0], K, 1, 1 if a_fp8 else x2.element_size(),
                               fp32_out=out_dtype == torch.float32, invariant=batch_invariant(),
                               interpret=interp, smem=fl.smem_budget(x2.device)) for w in ws]


def _one_launch_fits(ws, w_ss, plans) -> bool:
    """One launch reproduces each weight's separate call when every plan has the same tile
    (its constexprs; only the split differs per weight) and the weights are contiguous (the
    kernel takes their row strides from K)."""
    first = plans[0]
    same = all((p.block_m, p.block_n, p.swap_ab, p.num_warps, p.num_stages, p.fp8_mma,
                p.fold_splitk) == (first.block_m, first.block_n, first.swap_ab, first.num_warps,
                                   first.num_stages, first.fp8_mma, first.fold_splitk)
               for p in plans)
    return same and all(w.is_contiguous() and s.is_contiguous() for w, s in zip(ws, w_ss))


def _check_multi(x, x_s, ws, w_ss):
    if not 2 <= len(ws) <= MAX_WEIGHTS or len(w_ss) != len(ws):
        raise ValueError(f"ws and w_ss: 2 to {MAX_WEIGHTS} weights with one scale each, got "
                         f"{len(ws)} and {len(w_ss)}")
    K = ws[0].shape[-1]
    for j, w in enumerate(ws):
        if w.dim() != 2 or w.shape[1] != K:
            raise ValueError(f"ws[{j}]: every weight is [N, K] with the same K = {K}, got "
                             f"{tuple(w.shape)}")


def fp8_linear_multi_launch(x, x_s, ws, w_ss, out_dtype, plans=None) -> list:
    """The Triton path: one launch for every weight, or, where one launch cannot reproduce
    each weight's own plan (fp8_linear_launch's reference cases, mismatched tiles,
    non-contiguous weights, a capture before the tile counters exist), fp8_linear_launch per
    weight. `plans` overrides each weight's fp8_linear_plan."""
    _check_multi(x, x_s, ws, w_ss)
    separate = lambda: [fl.fp8_linear_launch(x, x_s, w, s, 1, out_dtype,   # noqa: E731
                                             plan=plans[j] if plans else None)
                        for j, (w, s) in enumerate(zip(ws, w_ss))]
    a16_ok = x.dtype in fl._A16_DTYPES and x.dtype == out_dtype
    if out_dtype not in fl._OUT_DTYPES or (x_s is None and not a16_ok):
        return separate()
    checked = [fl._check(x, x_s, w, s, 1) for w, s in zip(ws, w_ss)]
    x2, xs2, M, _, K = checked[0]
    Ns = [c[3] for c in checked]
    a_fp8 = xs2 is not None
    ps = _plans(x2, a_fp8, ws, out_dtype, plans)
    for p, N in zip(ps, Ns):
        if p.split_k * p.kb_per_split < K // fl.GROUP:
            raise ValueError(f"fp8_linear_multi: {p} does not cover K = {K} (N = {N})")
        fl.check_offsets(M, N)
    if M == 0 or not _one_launch_fits(ws, w_ss, ps):
        return separate()
    lead = x.shape[:-1]
    ys = [torch.empty((M, N), dtype=out_dtype, device=x.device) for N in Ns]
    p0 = ps[0]
    m_tiles = triton.cdiv(M, p0.block_m)
    tiles = [m_tiles * triton.cdiv(N, p0.block_n) for N in Ns]
    progs = [t * p.split_k for t, p in zip(tiles, ps)]
    split = [p.split_k > 1 for p in ps]
    cnt = None
    if any(split) and p0.fold_splitk:
        cnt = tile_counters(x.device, sum(tiles))
        if cnt is None:                 # capturing before the ring exists: two-launch path
            return separate()
    elif any(split):
        return separate()               # the two-launch path is fp8_linear's own
    part_sizes = [p.split_k * M * N if s else 0 for p, N, s in zip(ps, Ns, split)]
    part = torch.empty(sum(part_sizes), dtype=torch.float32, device=x.device)
    if cnt is None:
        cnt = ys[0].new_empty(0, dtype=torch.int32)      # never read: no weight splits K
    pad = MAX_WEIGHTS - len(ws)
    starts, poffs, coffs = _prefix(progs), _prefix(part_sizes), _prefix(tiles)
    w_args, s_args, y_args = (list(ws) + [ws[0]] * pad, list(w_ss) + [w_ss[0]] * pad,
                              ys + [ys[0]] * pad)
    ints = lambda v, fill: list(v) + [fill] * pad     # noqa: E731
    slots = []
    for j in range(MAX_WEIGHTS):
        slots += [w_args[j].view(torch.uint8), s_args[j].view(torch.uint8), y_args[j]]
    kernel = _fp8_linear_multi_kernel
    xs_arg = xs2 if a_fp8 else w_ss[0]          # unused without A_FP8; any pointer
    launch(kernel)[(sum(progs),)](
        x2.view(torch.uint8) if a_fp8 else x2, xs_arg, part, cnt, *slots,
        *ints(Ns, Ns[0]), *ints((p.split_k for p in ps), 1),
        *ints((p.kb_per_split for p in ps), 1), *ints(starts[1:], sum(progs)),
        *ints(poffs[1:], 0), *ints(coffs[1:], 0), M, K, m_tiles, x2.stride(0),
        xs_arg.stride(0), BLOCK_M=p0.block_m, BLOCK_N=p0.block_n, A_FP8=a_fp8,
        SWAP_AB=p0.swap_ab, NUM_STAGES=p0.num_stages, FP8_MMA=a_fp8 and p0.fp8_mma,
        NUM_W=len(ws), FOLD=any(split), SOFT=interpreting(kernel), num_warps=p0.num_warps)
    return [y.reshape(*lead, y.shape[-1]) for y in ys]


def _prefix(sizes) -> list:
    """[0, s0, s0 + s1, ...] (len(sizes) entries)."""
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _slots(w0, w_s0, w1, w_s1, w2, w_s2, w3, w_s3):
    """(ws, w_ss) of the weights present in the op's slots (the last two optional)."""
    if (w2 is None) != (w_s2 is None) or (w3 is None) != (w_s3 is None):
        raise ValueError("fp8_linear_multi: w2 / w3 each come with their scale w_s2 / w_s3")
    if w3 is not None and w2 is None:
        raise ValueError("fp8_linear_multi: w3 given without w2")
    pairs = [(w, s) for w, s in ((w0, w_s0), (w1, w_s1), (w2, w_s2), (w3, w_s3))
             if w is not None]
    return [w for w, _ in pairs], [s for _, s in pairs]


def _padded(x, ys, out_dtype):
    """The 4 returns: the outputs, then an empty [..., 0] per unused slot (outputs of a custom
    op must not alias each other)."""
    return tuple(ys) + tuple(x.new_empty((*x.shape[:-1], 0), dtype=out_dtype)
                             for _ in range(MAX_WEIGHTS - len(ys)))


def _multi_reference(x, x_s, w0, w_s0, w1, w_s1, w2, w_s2, w3, w_s3, out_dtype):
    ws, w_ss = _slots(w0, w_s0, w1, w_s1, w2, w_s2, w3, w_s3)
    return _padded(x, fp8_linear_multi_reference(x, x_s, ws, w_ss, out_dtype), out_dtype)


def _multi_fake(x, x_s, w0, w_s0, w1, w_s1, w2, w_s2, w3, w_s3, out_dtype):
    ws, _ = _slots(w0, w_s0, w1, w_s1, w2, w_s2, w3, w_s3)
    ys = [x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype) for w in ws]
    return _padded(x, ys, out_dtype)


@dspark_op("fp8_linear_multi", reference=_multi_reference, fake=_multi_fake)
def fp8_linear_multi(x: torch.Tensor, x_s: torch.Tensor | None, w0: torch.Tensor,
                     w_s0: torch.Tensor, w1: torch.Tensor, w_s1: torch.Tensor,
                     w2: torch.Tensor | None, w_s2: torch.Tensor | None, w3: torch.Tensor | None,
                     w_s3: torch.Tensor | None, out_dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ws, w_ss = _slots(w0, w_s0, w1, w_s1, w2, w_s2, w3, w_s3)
    return _padded(x, fp8_linear_multi_launch(x, x_s, ws, w_ss, out_dtype), out_dtype)


def fp8_linear_multi_list(x, x_s, ws, w_ss, out_dtype) -> list:
    """`torch.ops.dspark.fp8_linear_multi` on lists: [y_i = x W_i^T] for 2..4 weights."""
    if not 2 <= len(ws) <= MAX_WEIGHTS or len(w_ss) != len(ws):
        raise ValueError(f"ws and w_ss: 2 to {MAX_WEIGHTS} weights with one scale each, got "
                         f"{len(ws)} and {len(w_ss)}")
    pad = [None] * (2 * (MAX_WEIGHTS - len(ws)))
    args = [t for pair in zip(ws, w_ss) for t in pair] + pad
    return list(torch.ops.dspark.fp8_linear_multi(x, x_s, *args, out_dtype)[:len(ws)])


# SM12x readiness: fp8_linear's tiles and runs (kernels/fp8_linear.py), with 2 weights (the
# model's sets) and the folded split-K sum; the slot count only adds scalar selects.
for _bm, _bn, _swap, _warps, _st in sorted(set(fl.TILES.values()) |
                                           set(fl.INVARIANT_TILES.values())):
    for _xt, _yt, _a8, _f8 in fl._RUNS:
        _ab = 1 if _a8 else int(_xt[-2:]) // 8
        _types = fl.gemm_compile_types(_xt, _yt, _a8)
        for _j in range(MAX_WEIGHTS):
            _types.update({f"w{_j}": "*u8", f"s{_j}": "*u8", f"y{_j}": _yt,
                           f"N{_j}": fl._D16, f"SPLIT{_j}": "i32", f"KBS{_j}": "i32"})
        for _j in range(1, MAX_WEIGHTS):
            _types.update({f"START{_j}": "i32", f"POFF{_j}": "i32", f"COFF{_j}": "i32"})
        _types["M_TILES"] = "i32"
        add_compile_configs("fp8_linear_multi", [compile_config(
            _fp8_linear_multi_kernel, _types,
            dict(BLOCK_M=_bm, BLOCK_N=_bn, A_FP8=_a8, SWAP_AB=_swap,
                 NUM_STAGES=fl._stages(_bm, _bn, _ab, _st), FP8_MMA=_f8, NUM_W=2, FOLD=True,
                 SOFT=False), _warps)])
