"""Kernel benchmarks: eager PyTorch reference vs torch.compile of it vs our fused op.

    python benchmarks/kernel_bench.py --only qkv,act_quant --out benchmarks/results/h200_kernels
    python benchmarks/kernel_bench.py --dry-run          # CPU/GPU smoke test: build, run once, check
    python benchmarks/kernel_bench.py --only moe --batches 1,4,16,64 --out benchmarks/results/h200_moe

Cases come from this file (groups "qkv", "act_quant" and "moe", Flash dims: H=64, D=512, rope
64, nope 448, hidden 4096, shared-expert I=2048, 256 routed MXFP4 experts of I=2048, top 6;
B requests, T = 6B tokens = B * (N+1) verify rows)
and from every `benchmarks/*_cases.py` module exposing `cases(batches) -> list[harness.Case]`
(benchmarks/README.md). The moe_tp2 group times each rank's share of the routed experts at
tp = 2 under the expert split and the intermediate split (tp2_moe_cases). The moe cases (one
name per routing: moe_experts:top6-random, :one-expert, :every-expert) take bytes_moved = the touched-expert byte floor, and time the
`bf16-grouped` baseline, the new kernels on the checkpoint layout and the previous launcher
(benchmarks/_moe_previous/, when present) too; a dry run on a CPU builds them at
MOE_DRY_RUN_CPU dims.
Writes <out>/kernels.json (environment, copy bandwidth, rows), <out>/kernels.csv and
<out>/kernels.png (if matplotlib is installed), and prints a table.
"""
from __future__ import annotations

import argparse
import fnmatch
import glob
import importlib.util
import json
import os
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402
from harness import Case, TimingConfig, compare  # noqa: E402

from dspark_compile.kernels import act_quant as aq  # noqa: E402
from dspark_compile.kernels import moe  # noqa: E402
from dspark_compile.kernels import moe_layout  # noqa: E402
from dspark_compile.kernels import qkv_postprocess as qp  # noqa: E402

# Flash dimensions
H, D, R = 64, 512, 64
NOPE = D - R
HIDDEN, INTER = 4096, 2048
EPS, LIMIT = 1e-6, 10.0
MAX_POS = 8192
TOKENS_PER_REQUEST = 6  # N + 1 verify rows per request (dspark_block_size N = 5)


def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, device, seed, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(shape, generator=_gen(device, seed), device=device) * scale).to(dtype)


_TABLES: dict = {}


def _cos_sin(device):
    """One shared RoPE table per device (the step shares it too)."""
    if device not in _TABLES:
        inv = 1.0 / 10000.0 ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
        ang = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv[None, :]
        _TABLES[device] = torch.cat([ang.cos(), ang.sin()], 1).float().to(device)
    return _TABLES[device]


# ------------------------------------------------------------------------------------------------
# qkv group
# ------------------------------------------------------------------------------------------------

def _qkv_inputs(T, device, seed, with_cache):
    g = _gen(device, seed)
    d = {"q": _randn((T, H, D), device, seed, 3.0), "kv": _randn((T, D), device, seed + 1, 2.0),
         "positions": torch.randint(0, MAX_POS, (T,), generator=g, device=device),
         "cos_sin": _cos_sin(device)}
    S = max(4 * T, 1024) + 1                     # ring rows; every token gets a real slot
    slots = torch.randperm(S - 1, generator=g, device=device)[:T]
    if with_cache == "fp8":
        rnd = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g, device=device)
        d.update(slots=slots, cache_nope=rnd(S, NOPE).view(torch.float8_e4m3fn),
                 cache_scale=rnd(S, NOPE // 64), cache_rope=rnd(S, 2 * R).view(torch.bfloat16))
    elif with_cache == "ring":
        d.update(slots=slots, cache=_randn((S, D), device, seed + 2))
    return d


def _check_against_reference(make, ours, reference):
    """Run ours and the reference on two identical input sets; compare outputs and caches."""
    def check(device):
        a, b = make(device, 123), make(device, 123)
        out_a, out_b = ours(a), reference(b)
        outs = lambda o: [] if o is None else list(o) if isinstance(o, tuple) else [o]
        msgs = [compare(f"out{i}", x, y) for i, (x, y) in enumerate(zip(outs(out_a), outs(out_b)))]
        msgs += [compare(k, a[k], b[k], as_bytes=True)
                 for k in ("cache_nope", "cache_scale", "cache_rope", "cache") if k in a]
        return "; ".join(m for m in msgs if m)
    return check


def _make_qkv(T, cache, drop_q=False):
    def make(device, seed):
        d = _qkv_inputs(T, device, seed, cache)
        if drop_q:
            del d["q"]
        return d
    return make


def qkv_cases(batches):
    out = []
    for B in batches:
        T = TOKENS_PER_REQUEST * B
        act = T * H * D * 2                         # q in or out, bf16
        small = T * (8 + R * 4)                     # positions + cos/sin rows
        specs = [
            ("qkv_postprocess", _make_qkv(T, "fp8"),
             lambda d: qp.qkv_postprocess_reference(**d, eps=EPS),
             lambda d: torch.ops.dspark.qkv_postprocess(**d, eps=EPS),
             2 * act + T * D * 2 + small + T * 8 + T * (NOPE + NOPE // 64 + 2 * R)),
            ("qkv_rope", _make_qkv(T, None),
             lambda d: qp.qkv_rope_reference(**d, eps=EPS),
             lambda d: torch.ops.dspark.qkv_rope(**d, eps=EPS),
             2 * act + 2 * T * D * 2 + small),
            ("context_kv_store", _make_qkv(T, "ring", drop_q=True),
             lambda d: qp.context_kv_store_reference(**d),
             lambda d: torch.ops.dspark.context_kv_store(**d),
             2 * T * D * 2 + small + T * 8),
        ]
        for name, make, ref, ours, nbytes in specs:
            extra = {}
            if name == "qkv_postprocess":   # tuning data: heads per program (default 2 at D=512)
                extra = {f"ours-bh{bh}": (lambda d, bh=bh: qp.qkv_postprocess_launch(
                    **d, eps=EPS, block_h=bh)) for bh in (1, 4)}
            out.append(Case("qkv", name, {"B": B, "T": T}, make, ref, ours, nbytes,
                            check=_check_against_reference(make, ours, ref), extra=extra))
    return out


# ------------------------------------------------------------------------------------------------
# act_quant group
# ------------------------------------------------------------------------------------------------

def act_quant_cases(batches):
    out = []
    for B in batches:
        T = TOKENS_PER_REQUEST * B
        scales = lambda K: T * (K // aq.ACT_QUANT_GROUP) * 4
        specs = [
            ("swiglu_quant",
             lambda dev, s, T=T: {"g": _randn((T, INTER), dev, s, 4.0),
                                  "u": _randn((T, INTER), dev, s + 1, 4.0)},
             lambda d: aq.swiglu_quant_reference(d["g"], d["u"], LIMIT),
             lambda d: torch.ops.dspark.swiglu_quant(d["g"], d["u"], LIMIT),
             2 * T * INTER * 2 + T * INTER + scales(INTER)),
            ("rmsnorm_quant",
             lambda dev, s, T=T: {"x": _randn((T, HIDDEN), dev, s, 3.0),
                                  "weight": 1 + _randn((HIDDEN,), dev, s + 1, 0.2)},
             lambda d: aq.rmsnorm_quant_reference(d["x"], d["weight"], EPS),
             lambda d: torch.ops.dspark.rmsnorm_quant(d["x"], d["weight"], EPS),
             T * HIDDEN * 2 + HIDDEN * 2 + T * HIDDEN * 2 + T * HIDDEN + scales(HIDDEN)),
            ("act_quant",
             lambda dev, s, T=T: {"x": _randn((T, HIDDEN), dev, s, 3.0)},
             lambda d: aq.act_quant_reference(d["x"]),
             lambda d: torch.ops.dspark.act_quant(d["x"]),
             T * HIDDEN * 2 + T * HIDDEN + scales(HIDDEN)),
        ]
        for name, mk, ref, ours, nbytes in specs:
            out.append(Case("act_quant", name, {"B": B, "T": T}, mk, ref, ours, nbytes,
                            check=_check_against_reference(mk, ours, ref)))
    return out


# ------------------------------------------------------------------------------------------------
# moe group: dspark::moe_experts (routed MXFP4 experts)
# ------------------------------------------------------------------------------------------------

class MoeDims(NamedTuple):    # a NamedTuple: this script is loaded without a sys.modules entry
    experts: int = 256
    hidden: int = HIDDEN
    inter: int = INTER
    top_k: int = 6

    def expert_bytes(self) -> int:
        """w1, w3 [I, D/2] + [I, D/32] scales, w2 [D, I/2] + [D, I/32]: 13.37 MB at Flash."""
        D, I = self.hidden, self.inter
        return 2 * (I * D // 2 + I * D // 32) + D * I // 2 + D * I // 32


MOE_ROUTINGS = ("top6-random", "one-expert", "every-expert")


def _moe_ids(T, dims: MoeDims, routing: str) -> torch.Tensor:
    """[T, k] expert ids (CPU, fixed per case: the routing sets the byte floor).
    top6-random: the top k of uniform scores per token (distinct experts, as the gate);
    one-expert: every pair on expert 0 (adversarial: one expert's rows, 6T of them);
    every-expert: pair p on expert p mod E (as many experts as pairs allow: all at T >= 43)."""
    E, k = dims.experts, dims.top_k
    if routing == "top6-random":
        return torch.rand(T, E, generator=_gen("cpu", 7 + T)).topk(k, -1).indices
    if routing == "one-expert":
        return torch.zeros(T, k, dtype=torch.int64)
    return (torch.arange(T * k) % E).reshape(T, k)


def _moe_inputs(T, dims: MoeDims, ids: torch.Tensor):
    """Weights per set (random bytes for the touched experts, zeros elsewhere), so rotating sets
    reads every touched weight byte from memory, not from L2; each set holds them in the
    checkpoint layout (w1, s1, ...) and in the kernel's tiled layout (tiled, layout), as the
    engine stores them (kernels/moe_layout.py)."""
    E, D, I, k = dims.experts, dims.hidden, dims.inter, dims.top_k
    touched = sorted(i for i in set(ids.reshape(-1).tolist()) if i >= 0)   # -1: another rank's

    def make(device, seed):
        g = _gen(device, seed)
        d = {"x": _randn((T, D), device, seed, 1.0), "topk_ids": ids.to(device),
             "topk_weights": torch.rand(T, k, generator=g, device=device) + 0.1}
        t_idx = torch.tensor(touched, device=device)
        for name, (rows, cols) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            w = torch.zeros(E, rows, cols // 2, dtype=torch.uint8, device=device)
            sc = torch.full((E, rows, cols // 32), 127, dtype=torch.uint8, device=device)
            w[t_idx] = torch.randint(0, 256, (len(touched), rows, cols // 2), dtype=torch.uint8,
                                     generator=g, device=device)
            # scale bytes 118..123: weights ~2^-7..2^-2, outputs of order 1
            sc[t_idx] = torch.randint(118, 124, (len(touched), rows, cols // 32),
                                      dtype=torch.uint8, generator=g, device=device)
            d[name], d["s" + name[1]] = w, sc
        d["tiled"], d["layout"] = moe_layout.experts_to_kernel(
            *(d[n] for n in ("w1", "s1", "w3", "s3", "w2", "s2")))
        return d
    return make, touched


def _moe_args(d):
    return (d["x"], d["topk_ids"], d["topk_weights"], d["w1"], d["s1"], d["w3"], d["s3"],
            d["w2"], d["s2"], LIMIT)


def _moe_tiled_args(d):
    return (d["x"], d["topk_ids"], d["topk_weights"], *d["tiled"], LIMIT, d["layout"])


def _moe_bf16_grouped(touched, k):
    """The bf16 grouped baseline: weights of the touched experts dequantized once (first call,
    before capture), then per touched expert the gathered rows' GEMMs, SwiGLU, weighted
    index_add (float atomics: a baseline, not bit-reproducible)."""
    def run(d):
        if "_grouped" not in d:
            flat = d["topk_ids"].reshape(-1)
            deq = lambda w, s, e: moe.mxfp4_dequant(w[e], s[e], torch.bfloat16)
            d["_grouped"] = [((flat == e).nonzero().flatten(),
                              deq(d["w1"], d["s1"], e), deq(d["w3"], d["s3"], e),
                              deq(d["w2"], d["s2"], e)) for e in touched]
        x, wt = d["x"], d["topk_weights"].reshape(-1)
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for pairs, W1, W3, W2 in d["_grouped"]:
            tok = pairs // k
            xe = x[tok]
            h = aq.swiglu(xe @ W1.T, xe @ W3.T, LIMIT)
            y.index_add_(0, tok, (h @ W2.T).float() * wt[pairs, None])
        return y
    return run


PREVIOUS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_moe_previous")


def _moe_previous():
    """The launcher before the tiled layout (a copy of 96a1af8's kernels/moe.py and
    moe_kernels.py in benchmarks/_moe_previous/, uncommitted: the same-run baseline of
    benchmarks/results/h200_moe_2026-12-02/); None when the folder is absent."""
    if not os.path.isdir(PREVIOUS_DIR):
        return None
    sys.path.insert(0, PREVIOUS_DIR)
    import moe_prev  # noqa: E402
    return moe_prev


# Tile sweep (tuning data for moe_layout.tile_for): label -> (gate/up tile, down tile, warps,
# stages); each builds its own layout of the set's weights where the tiles divide the dims.
MOE_TILE_SWEEP = {"tile-128x128": ((64, 128), (64, 128), 4, 3),
                  "tile-gu128": ((64, 128), (64, 256), 4, 3),
                  "tile-dn128": ((64, 256), (64, 128), 4, 3),
                  "tile-st2": ((64, 256), (64, 256), 4, 2),
                  "tile-st4": ((64, 256), (64, 256), 4, 4),
                  "tile-128rows-w8": ((128, 256), (128, 256), 8, 3)}


def _fits(dims: MoeDims, gu, dn) -> bool:
    return (dims.inter % gu[0] == dims.hidden % gu[1] == 0
            and dims.hidden % dn[0] == dims.inter % dn[1] == 0)


def _swept_layout(d, gu, dn):
    """The set's weights in the tiled layout at tiles (gu, dn), built once per set."""
    key = ("_swept", gu, dn)
    if key not in d:
        laid = (moe_layout.to_kernel(d["w1"], d["s1"], gu) + moe_layout.to_kernel(d["w3"], d["s3"], gu)
                + moe_layout.to_kernel(d["w2"], d["s2"], dn))
        d[key] = (laid, moe_layout.TiledLayout(gu, dn).name)
    return d[key]


def _moe_part(d, upto: str):
    """Only the routing kernel, or routing + gate/up, of the engine's call (where its time
    goes): the launcher's own steps, stopped early."""
    from dspark_compile.kernels import moe_kernels as mk
    from dspark_compile.kernels.tl_helpers import launch
    x, ids = d["x"], d["topk_ids"]
    w1, s1, w3, s3 = d["tiled"][:4]
    E = w1.shape[0]
    route = moe.moe_route_launch(ids, E)
    if upto == "route":
        return route[3]
    plan = moe.moe_plan(E, x.shape[1], w1.shape[1] * w1.shape[3], d["layout"])
    (bn, bk), I, D = plan.gate_up_tile, w1.shape[1] * w1.shape[3], x.shape[1]
    h = torch.empty(route[1].shape[0] * moe.BLOCK_M, I, dtype=x.dtype, device=x.device)
    launch(mk._moe_gate_up_kernel)[(route[1].shape[0], I // bn)](
        x, w1, s1.view(torch.uint8), w3, s3.view(torch.uint8), h, *route, D, I, ids.shape[1],
        x.stride(0), LIMIT, BLOCK_M=moe.BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, TILED=True, WIDE=False,
        IEEE=False, SOFT=False, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return h


def _moe_variants(T, dims: MoeDims) -> dict:
    """Same-run comparisons: the new kernels on the checkpoint layout (the eager model's), the
    previous launcher (if present), the tile sweep, and the routing / gate-up parts alone."""
    out = {"ours-checkpoint": lambda d: moe.moe_experts_launch(*_moe_args(d)),
           "part-route": lambda d: _moe_part(d, "route"),
           "part-route-gate-up": lambda d: _moe_part(d, "gate_up")}
    for label, (gu, dn, warps, stages) in MOE_TILE_SWEEP.items():
        if not _fits(dims, gu, dn):
            continue
        plan = moe.MoePlan(gu, dn, True, False, num_warps=warps, num_stages=stages)

        def run(d, gu=gu, dn=dn, plan=plan):
            laid, name = _swept_layout(d, gu, dn)
            return moe.moe_experts_launch(d["x"], d["topk_ids"], d["topk_weights"], *laid, LIMIT,
                                          name, plan=plan)
        out[label] = run
    prev = _moe_previous()
    if prev is not None:
        out["previous"] = lambda d: prev.moe_experts_launch(*_moe_args(d))
    return out


def moe_cases(batches, dims: MoeDims = MoeDims()):
    """moe_experts at T = 6B tokens per routing; bytes_moved = the touched-expert floor (touched
    x 3 matrices with their scales) + x, ids, weights read and y (fp32) written. `ours` is the
    engine's call: the tiled layout."""
    out = []
    for B in batches:
        T = TOKENS_PER_REQUEST * B
        for routing in MOE_ROUTINGS:
            ids = _moe_ids(T, dims, routing)
            make, touched = _moe_inputs(T, dims, ids)
            nbytes = (len(touched) * dims.expert_bytes() + T * dims.hidden * (2 + 4)
                      + ids.numel() * (8 + 4))
            ref = lambda d: moe.moe_experts_reference(*_moe_args(d))
            ours = lambda d: torch.ops.dspark.moe_experts(*_moe_tiled_args(d))
            # the eager reference runs every expert on every token (seconds at Flash);
            # torch.compile of its 256-expert loop would take longer than the run
            # one name per routing: one plot panel each (`--ops moe_experts:one-expert`)
            out.append(Case("moe", f"moe_experts:{routing}",
                            {"B": B, "T": T, "routing": routing, "touched": len(touched)},
                            make, ref, ours, nbytes,
                            check=_check_against_reference(make, ours, ref),
                            extra={"bf16-grouped": _moe_bf16_grouped(touched, dims.top_k),
                                   **_moe_variants(T, dims)},
                            compile=False))
    return out


def tp2_moe_cases(batches, dims: MoeDims = MoeDims()):
    """Issue 53's choice between the two ways to split the routed experts over tp = 2 ranks,
    each rank's share timed on one GPU, on the same top6-random routing as moe_experts:
    - `moe_experts:tp2-expert-r0` / `-r1` (expert parallel, models/sharding.py): rank r holds
      experts [r E/2, (r+1) E/2) whole and computes the pairs routed to them (the others' ids
      -1, which the op skips); the step waits for the slower rank;
    - `moe_experts:tp2-intermediate`: every rank holds every expert's I / 2 slice (w1 / w3 rows,
      w2 columns: whole MXFP4 blocks) and computes every pair at half width.
    Both end in the one all-reduce of the MoE's [T, D] output; what differs is this time."""
    out = []
    half_e = dims._replace(experts=dims.experts // 2)
    half_i = dims._replace(inter=dims.inter // 2)
    for B in batches:
        T = TOKENS_PER_REQUEST * B
        ids = _moe_ids(T, dims, "top6-random")
        shares = {f"tp2-expert-r{r}": (half_e, torch.where(
            (ids >= r * half_e.experts) & (ids < (r + 1) * half_e.experts),
            ids - r * half_e.experts, torch.full_like(ids, -1))) for r in range(2)}
        shares["tp2-intermediate"] = (half_i, ids)
        for name, (d, rank_ids) in shares.items():
            make, touched = _moe_inputs(T, d, rank_ids)
            pairs = int((rank_ids >= 0).sum())
            nbytes = (len(touched) * d.expert_bytes() + T * d.hidden * (2 + 4)
                      + rank_ids.numel() * (8 + 4))
            ref = lambda x: moe.moe_experts_reference(*_moe_args(x))
            ours = lambda x: torch.ops.dspark.moe_experts(*_moe_tiled_args(x))
            out.append(Case("moe_tp2", f"moe_experts:{name}",
                            {"B": B, "T": T, "routing": "top6-random", "touched": len(touched),
                             "pairs": pairs, "experts": d.experts, "inter": d.inter},
                            make, ref, ours, nbytes,
                            check=_check_against_reference(make, ours, ref), compile=False))
    return out


# a CPU dry run builds the moe cases at these dims: the Flash reference (256 experts, every
# expert on every token) takes minutes per call on a CPU
MOE_DRY_RUN_CPU = MoeDims(experts=8, hidden=128, inter=64, top_k=6)


def cases(batches, moe_dims: MoeDims = MoeDims()):
    """This file's own cases, by the same protocol as benchmarks/*_cases.py."""
    return (qkv_cases(batches) + act_quant_cases(batches) + moe_cases(batches, moe_dims)
            # the half-width experts need I / 2 a multiple of the layout's 128-wide K tile
            + tp2_moe_cases(batches, moe_dims if moe_dims.inter % 256 == 0
                            else moe_dims._replace(inter=256)))


CASE_DIR = os.path.dirname(os.path.abspath(__file__))


def collect_cases(batches, case_dir: str = CASE_DIR, moe_dims: MoeDims = MoeDims()) -> list[Case]:
    """This file's cases plus every <case_dir>/*_cases.py module's `cases(batches)`."""
    found = cases(batches, moe_dims)
    for path in sorted(glob.glob(os.path.join(case_dir, "*_cases.py"))):
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if not hasattr(mod, "cases"):
            raise AttributeError(f"{path} defines no cases(batches) function")
        more = mod.cases(batches)
        bad = [c for c in more if not isinstance(c, Case)]
        if bad:
            raise TypeError(f"{path}: cases() must return harness.Case objects, got {type(bad[0])}")
        found += more
    return found


# ------------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------------

def variants(case: Case, compile_modes: list[str], patterns: list[str] | None = None) -> dict:
    """Every timed variant of a case, by label; with patterns (fnmatch, e.g. "ours*"), only the
    labels matching one of them (tuning runs skip the slow references; torch.compile is then
    not even set up)."""
    def keep(label):
        return patterns is None or any(fnmatch.fnmatchcase(label, p) for p in patterns)
    v = {"eager": case.reference} if keep("eager") else {}
    if case.compile:
        for mode in compile_modes:
            label = "compile" if mode == "default" else f"compile-{mode}"
            kwargs = {} if mode == "default" else {"mode": mode}
            if keep(label):
                v[label] = torch.compile(case.reference, **kwargs)
    if case.ours is not None and keep("ours"):
        v["ours"] = case.ours
    v.update({k: fn for k, fn in case.extra.items() if keep(k)})
    return v


def run(args) -> dict:
    batches = args.batches
    only = set(args.only.split(",")) if args.only else None
    ops = set(args.ops.split(",")) if args.ops else None
    small = args.dry_run and not torch.cuda.is_available()
    moe_dims = MOE_DRY_RUN_CPU if small else MoeDims()
    selected = [c for c in collect_cases(batches, args.case_dir, moe_dims)
                if (only is None or c.group in only) and (ops is None or c.name in ops)]
    if not selected:
        raise SystemExit(f"no case matches --only {args.only} --ops {args.ops}")
    if args.dry_run:
        return dry_run(selected)
    if not torch.cuda.is_available():
        raise SystemExit("timing needs a CUDA GPU (use --dry-run to smoke-test the cases)")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    dev = torch.device("cuda")
    cfg = TimingConfig(calls_per_graph=args.calls_per_graph, replays=args.replays,
                       warmup=args.warmup, rotate_factor=args.rotate_factor,
                       variant_budget_s=args.variant_budget)
    env = harness.environment(args.git_commit)
    bw = harness.measure_copy_bandwidth()
    print(f"{env.get('device')}: copy bandwidth {bw['bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    modes = ["default"] + (["max-autotune-no-cudagraphs"] if args.max_autotune else [])
    patterns = args.variants.split(",") if args.variants else None
    rows = []
    for case in selected:
        torch._dynamo.reset()              # each case compiles fresh: no cache-limit fallbacks
        n_sets = harness.num_input_sets(case.bytes_moved, cfg)
        sets = [case.make_inputs(dev, 1000 + i) for i in range(n_sets)]
        check = case.check(dev) if case.check else ""
        base = {"group": case.group, "name": case.name, **case.params, "n_sets": n_sets,
                "rotation_mb": n_sets * case.bytes_moved / 1e6, "bytes": case.bytes_moved,
                "check": check}
        case_rows = []
        for label, fn in variants(case, modes, patterns).items():
            try:
                t = harness.time_variant(fn, sets, cfg)
            except Exception as e:  # noqa: BLE001 -- a failing variant must not end the run
                t = {"us_median": None, "note": f"{type(e).__name__}: {str(e)[:200]}"}
            row = dict(base, variant=label, **t)
            if row["us_median"]:
                row["gb_per_s"] = case.bytes_moved / (row["us_median"] * 1e-6) / 1e9
                row["pct_copy_bw"] = 100 * row["gb_per_s"] * 1e9 / bw["bytes_per_s"]
            case_rows.append(row)
            print(f"  {case.name} {case.params} {label}: {row.get('us_median')} us "
                  f"{row.get('note', '')}", flush=True)
        ref = next((r["us_median"] for r in case_rows if r["variant"] == "compile"), None)
        for r in case_rows:
            r["speedup_vs_compile"] = ref / r["us_median"] if ref and r["us_median"] else None
        rows += case_rows
        del sets
        torch.cuda.empty_cache()
        if args.out:                 # after every case: a run cut short keeps what it measured
            write_results(args.out, {"environment": env, "copy_bandwidth": bw,
                                     "timing": vars(cfg), "rows": rows, "complete": False})
    return {"environment": env, "copy_bandwidth": bw, "timing": vars(cfg), "rows": rows,
            "complete": True}


def write_results(out: str, result: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kernels.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    harness.write_csv(os.path.join(out, "kernels.csv"), result["rows"])


def dry_run(selected) -> dict:
    """Build one input set per case, run reference and ours once (extras too on a GPU) and the
    check; no torch.compile, no timing."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for case in selected:
        d = case.make_inputs(dev, 0)
        case.reference(d)
        if case.ours is not None:
            case.ours(case.make_inputs(dev, 1))
        if dev.type == "cuda":       # extras may call Triton launchers directly: GPU only
            for fn in case.extra.values():
                fn(case.make_inputs(dev, 2))
        check = case.check(dev) if case.check else ""
        rows.append({"group": case.group, "name": case.name, **case.params, "variant": "dry-run",
                     "bytes": case.bytes_moved, "check": check})
    return {"environment": harness.environment(), "rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated case groups (qkv,act_quant,moe,...)")
    p.add_argument("--ops", default="", help="comma-separated op names within the groups")
    p.add_argument("--batches", type=bench_args.ordered_ints, default="1,4,16,64",
                   help="requests per step, B (T = 6B)")
    p.add_argument("--out", default="", help="output folder for kernels.json/.csv/.png")
    p.add_argument("--max-autotune", action="store_true",
                   help='also time torch.compile(mode="max-autotune-no-cudagraphs"); slow')
    p.add_argument("--calls-per-graph", type=int, default=64)
    p.add_argument("--replays", type=int, default=60)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rotate-factor", type=float, default=2.0)
    p.add_argument("--variant-budget", type=float, default=20.0,
                   help="seconds a slow variant may take: fewer calls per graph / replays")
    p.add_argument("--variants", default="",
                   help='comma-separated fnmatch patterns of the variant labels to time '
                        '("ours*,compile")')
    bench_args.add_git_commit(p)
    p.add_argument("--dry-run", action="store_true", help="build and run each case once, no timing")
    p.add_argument("--case-dir", default=CASE_DIR, help="folder searched for *_cases.py modules")
    args = p.parse_args(argv)
    result = run(args)
    rows = result["rows"]
    cols = ["name", "B", "T", "touched", "variant", "us_median", "us_p90", "pct_copy_bw",
            "speedup_vs_compile", "method", "check"]
    print(harness.format_table(rows, [c for c in cols if any(c in r for r in rows)]))
    if args.out:
        write_results(args.out, result)
        print(harness.write_plot(os.path.join(args.out, "kernels.png"), rows))
    return result


if __name__ == "__main__":
    main()
