"""Shared sampling math (reference): logits processing, Gumbel-max, plain target sampling.

Conventions every sampler of the project follows (the Markov draft sampler, rejection sampling,
plain target decoding), all fixed-shape and capture-safe:

- A row is greedy iff temperature[b] <= 0. Greedy rows take argmax of the raw logits (ties ->
  lowest id).
- Otherwise z = logits / T (fp32), then
  * top-k keeps every token whose z is >= the k-th largest z (top_k <= 0 or >= V: off). Ties at
    the k-th value are all kept, which makes the kept set a threshold `z >= tau`: that is what a
    fused kernel can compute without sorting, and it is what vLLM's threshold masking does.
  * top-p keeps the smallest set of the largest tokens whose mass reaches top_p (top_p >= 1 or
    NaN: off; at least the top token is always kept), measured on the distribution left after
    top-k. In threshold form: tau_p = the largest value v with mass(z >= v) >= top_p * Z, where
    masses are exp(z - max) and Z is their total over the top-k set. Ties at tau_p are kept.
  * p = softmax over the kept tokens.
- A degenerate row (any NaN, or a maximum that is not finite: all -inf, or +inf present) yields
  token 0 and probabilities that are all (finite) zeros. Greedy rows follow the same rule.
- Sampling from a distribution p is Gumbel-max: argmax_v(log p(v) + g(v)) with
  g = kernels.philox.vocab_gumbel(seed, position of the token being sampled, V, stream) (token v:
  word v % 4 of Philox(seed, c0 = v // 4, c1 = position, c2 = stream));
  excluded tokens (p = 0) never win; nothing left -> token 0.
- Token ids outside [0, V) are folded to 0 before they index anything.

The cumulative masses of top-p are summed in float64 here: the reference should be the exact
definition, and fused kernels sum fixed-point masses (order independent, so deterministic). The
two agree except where a token's mass-above lies within ~1e-7 of top_p * Z.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.philox import STREAM_TARGET, vocab_gumbel
from dspark_compile.kernels.region import fusable
from dspark_compile.kernels.tl_helpers import (
    compile_config, launch, multiprocessors, next_pow2, pdl_enter, pdl_launch, pdl_release)

NEG_INF = float("-inf")


def fold_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids outside [0, vocab) -> 0 (same dtype and shape)."""
    return torch.where((ids >= 0) & (ids < vocab), ids, torch.zeros_like(ids))


def greedy_rows(temperature: torch.Tensor) -> torch.Tensor:
    """[B] bool: temperature <= 0 (a NaN temperature is not greedy; its row is degenerate)."""
    return temperature <= 0


def degenerate_rows(x: torch.Tensor) -> torch.Tensor:
    """[B] bool: the row holds a NaN or its maximum is not finite (amax propagates NaN)."""
    return ~torch.isfinite(x.amax(-1))


def argmax_tokens(x: torch.Tensor) -> torch.Tensor:
    """Lowest-id argmax over the last dim; degenerate rows -> 0. int64."""
    tok = torch.argmax(torch.where(torch.isnan(x), torch.zeros_like(x), x), dim=-1)
    return torch.where(degenerate_rows(x), torch.zeros_like(tok), tok)


def _check_rows(name: str, t: torch.Tensor, B: int, dtypes) -> None:
    if t.shape != (B,) or t.dtype not in dtypes:
        raise ValueError(f"{name} must be a [{B}] tensor of {[str(d) for d in dtypes]}, got "
                         f"{t.dtype} {tuple(t.shape)}")


FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INTS = (torch.int64, torch.int32)


def check_sampling_params(B: int, temperature, top_k, top_p, seed=None, position=None,
                          position_name: str = "position") -> None:
    """Clear errors naming the argument for mis-shaped or mis-typed sampling metadata."""
    _check_rows("temperature", temperature, B, FLOATS)
    _check_rows("top_k", top_k, B, INTS)
    _check_rows("top_p", top_p, B, FLOATS)
    if seed is not None:
        _check_rows("seed", seed, B, INTS)
    if position is not None:
        _check_rows(position_name, position, B, INTS)


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Masked, temperature-scaled logits fp32 [B, V]; excluded tokens are -inf.

    Degenerate rows come back all -inf. Greedy rows are processed as if T = 1 (their consumers
    use argmax of the raw logits instead).
    """
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a float [B, V] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    B, V = logits.shape
    check_sampling_params(B, temperature, top_k, top_p)
    t = temperature.float()
    t = torch.where(greedy_rows(t), torch.ones_like(t), t)
    z = logits.float() / t[:, None]
    bad = degenerate_rows(z)
    z = torch.where(bad[:, None], torch.zeros_like(z), z)  # keep NaN out of the sorts below
    ninf = torch.full_like(z, NEG_INF)

    # top-k: threshold at the k-th largest value (ties kept)
    k = top_k.to(torch.int64)
    k_on = (k > 0) & (k < V)
    srt = torch.sort(z, dim=-1, descending=True).values
    kth = srt.gather(1, (k.clamp(1, V) - 1)[:, None])
    z = torch.where(k_on[:, None] & (z < kth), ninf, z)

    # top-p on the top-k distribution: tau = sorted value at the first index whose inclusive
    # cumulative mass reaches top_p * Z (float64 masses: the exact definition)
    p = top_p.double()
    p_on = p < 1.0                                  # NaN compares False: off
    srt = torch.sort(z, dim=-1, descending=True).values
    m = srt[:, :1]
    mass = torch.exp(srt.double() - m.double())     # -inf -> 0
    cum = torch.cumsum(mass, dim=-1)
    target = p[:, None] * cum[:, -1:]
    n_finite = torch.isfinite(srt).sum(-1, keepdim=True)
    J = torch.minimum((cum < target).sum(-1, keepdim=True), n_finite - 1).clamp_min(0)
    tau = srt.gather(1, J)
    z = torch.where(p_on[:, None] & (z < tau), ninf, z)
    return torch.where(bad[:, None], ninf, z)


def probs_from_processed(z: torch.Tensor) -> torch.Tensor:
    """softmax over the kept (finite) tokens of processed logits; degenerate rows -> zeros."""
    bad = degenerate_rows(z)
    p = torch.softmax(torch.where(bad[:, None], torch.zeros_like(z), z), dim=-1)
    return torch.where(bad[:, None], torch.zeros_like(p), p)


def process_requests(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """process_logits of n rows of logits [B, n, V] per request, each with its request's
    parameters: [B * n, V] fp32."""
    B, n, V = logits.shape
    rep = lambda t: t.repeat_interleave(n)  # noqa: E731  per-request -> per-row
    return process_logits(logits.reshape(B * n, V), rep(temperature), rep(top_k), rep(top_p))


def request_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """softmax(process(...)) [B, n, V] fp32 of n rows of logits [B, n, V] per request (the draft
    distributions q of markov_sample's draft_logits, the target distributions p of rejection
    sampling)."""
    B, n, V = logits.shape
    return probs_from_processed(process_requests(logits, temperature, top_k, top_p)) \
        .reshape(B, n, V)


def logprobs_from_processed(z: torch.Tensor) -> torch.Tensor:
    """log_softmax over the kept tokens (-inf elsewhere); degenerate rows all -inf."""
    bad = degenerate_rows(z)
    lp = torch.log_softmax(torch.where(bad[:, None], torch.zeros_like(z), z), dim=-1)
    return torch.where(bad[:, None] | torch.isinf(z), torch.full_like(lp, NEG_INF), lp)


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, V: int, stream: int) -> torch.Tensor:
    """[B, V] fp32 Gumbel noise keyed (seed[b], position[b], stream): philox.vocab_gumbel."""
    return vocab_gumbel(seed, position, V, stream)


def gumbel_argmax(logw: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                  stream: int) -> torch.Tensor:
    """Gumbel-max sample from log-weights logw [B, V] (-inf: excluded). Nothing left -> 0."""
    s = logw.float() + gumbel_noise(seed, position, logw.shape[-1], stream)
    s = torch.where(torch.isnan(s), torch.full_like(s, NEG_INF), s)
    tok = torch.argmax(s, dim=-1)
    return torch.where(torch.isfinite(s.amax(-1)), tok, torch.zeros_like(tok))


@fusable("sample")
def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, seed: torch.Tensor,
                     position: torch.Tensor) -> torch.Tensor:
    """Plain target sampling: tokens [B] int64 (greedy rows argmax, others Gumbel-max with
    STREAM_TARGET keyed by `position`, the position of the token being sampled)."""
    B = logits.shape[0]
    check_sampling_params(B, temperature, top_k, top_p, seed, position)
    greedy = argmax_tokens(logits.float())
    z = process_logits(logits, temperature, top_k, top_p)
    sampled = gumbel_argmax(logprobs_from_processed(z), seed, position, STREAM_TARGET)
    return torch.where(greedy_rows(temperature), greedy, sampled)


# ----------------------------------------------------------------------------------------------
# Triton device helpers shared by the fused samplers (markov_sampler.py, rejection.py)
# ----------------------------------------------------------------------------------------------
#
# Exact top-k / top-p without sorting. A row's kept set is {z >= tau}; tau is found in steps that
# each touch the row once and never hold more than a tile of it:
#   1. a mass histogram of d = max - z: per bin of HIST_SPAN / NB nats, the exact token count
#      and the summed mass exp(z - max) (fp32);
#   2. `bracket`: from the bins' masses (within a relative MASS_EPS) and exact counts, the bin
#      range [jlo, jhi] that must contain tau: for top-p, usually the single bin where the
#      cumulative mass crosses top_p * Z;
#   3. one pass (select) sums the exact fixed-point masses of the tokens above the range and
#      gathers the tokens inside it (the candidates, at most CAP); `resolve` bisects over their
#      fp32 bit keys for the exact tau. Overflow (> CAP candidates: near-flat rows, where top-p
#      0.95 keeps most of the vocabulary and one 2-nat bin holds 10^4+ tokens) spills the
#      bracket's tokens into per-chunk regions instead, and the radix refinement below reads only
#      those: each pass splits the overflowing value range at REFINE_EDGES edges and sums the
#      masses above each, so it narrows by ~REFINE_EDGES (REFINE_PASSES more launches). What
#      that cannot decide (top-k and top-p both on with > CAP tokens between their thresholds,
#      > CAP tokens within ~1 ulp, a wrong bracket) falls back to `resolve_by_scan`, which
#      bisects with a full row scan per probe: exact, slow.
# Masses are exp(z - max) in fixed point (int64, 2^SCALE_BITS per unit) wherever they decide
# something: sums are exact and order-independent, so the result does not depend on which
# program finished first. The fp32 bin masses only place the bracket (resolve() checks it).
#
# How it got here (H200, B = 64, top-p 0.95 over randn * 3 rows, the whole Markov call):
# - The first version counted tokens per bin (tl.histogram) and bounded a bin's mass by
#   count * [e^-(j+1)w, e^-jw]. Those bounds are only as tight as the bin is narrow: it needed
#   1024 bins of 1/32 nat (5.1 ms per call). Summed masses make the bracket one bin wide
#   whatever the width, so a few bins do: 3.99 ms with 16.
# - Structure, not arithmetic: every pass reduced each tile across the CTA (5-6 barriers per
#   1024 tokens). Per-lane partials reduced once per program: 2.31 ms.
# - Latency and occupancy (benchmarks/row_pass_probe.py timed the loops alone): the passes
#   waited on one small load at a time, behind a dependent block-maximum load, at 2 programs per
#   SM (the resolving program's registers). Loads now run a tile or two ahead, select reads
#   every tile (no block-max check) at 8 warps x 512 tokens (64 registers), and an overflowing
#   bracket is spilled so refinement reads a tenth of the row: 1.33 ms. The histogram itself
#   is now the bound: binning costs ~5 instructions per token and bin (8 bins: the reduce pass
#   ~2x faster, but twice the tokens spilled and refined, 1.55 ms overall; 32 bins 2.27 ms).
# - Session 7: the whole Markov call (reduce's input, the logits kernel, included), B = 64:
#   programmatic dependent launch between the launches, 1.36 -> 1.34 ms (1.06 -> 0.94 ms on
#   peaked rows with the floor below); top-p rows search only above the block maxima's floor
#   (block_max_floor), which on peaked rows skips most of a row; the last program reads every
#   chunk histogram at once (sum_hists; -23 us per call at B = 1).

HIST_BINS = 16            # NB: bins of 2 nats cover d in [0, HIST_SPAN), the last bin is open
HIST_SPAN = tl.constexpr(32.0)   # nats below the row max the histogram bins split evenly
REFINE_EDGES = 16         # edges per refinement pass (over the spilled bracket only)
CAND_CAP = 2048           # candidates resolved in registers by one program
# relative error allowed for an fp32 bin mass (sums of <= 10^4 fp32 terms per program, then
# <= 64 chunk partials: < 1e-5; exp error ~1e-7): it only widens a bracket
MASS_EPS = tl.constexpr(1e-4)


SELECT_WARPS = 8          # row_select / row_refine: their last program resolves CAP candidates


def select_tile(tile: int) -> int:
    """Tokens per load of row_select_kernel: 512 at 8 warps keeps it at 64 registers on sm_90
    (4 programs per SM; 1024 tokens took 128, and the pass waited on memory)."""
    return min(tile, 512)


def row_tiling(rows: int, V: int, tile: int | None = None, chunk: int | None = None):
    """(TILE, CHUNK, C): TILE tokens per vector op, CHUNK tokens per program of the row passes.

    Few rows get more, shorter chunks so the row passes still fill the GPU.
    """
    TILE = tile or min(1024, max(16, next_pow2(V)))   # >= 16: whole Philox blocks per tile
    if TILE < 16 or TILE & (TILE - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {TILE}")
    if chunk is None:
        chunk = 2048 if rows <= 4 else 4096 if rows <= 16 else 8192
    CHUNK = max(TILE, chunk // TILE * TILE)
    return TILE, CHUNK, triton.cdiv(V, CHUNK)


def hist_tile(tile: int, nb: int) -> int:
    """Tokens per load of the histogram passes (reduce, refine): they keep per-lane [tile, nb]
    histograms in registers, so 2048 cells (16 per thread at 4 warps), which leaves room for
    the next tiles' loads in flight (H200: 256 x 8 with two tiles prefetched ran the reduce
    loop in half the time of 256 x 16 without, benchmarks/row_pass_probe.py)."""
    return max(16, min(tile, 2048 // nb))


def refine_tile(tile: int, edges: int) -> int:
    """hist_tile for row_refine_kernel, which runs SELECT_WARPS warps."""
    return hist_tile(tile, edges) * SELECT_WARPS // 4


def mass_scale_bits(V: int) -> int:
    """Fixed-point fraction bits: V masses <= 1 sum below 2^62."""
    return 61 - max(int(V - 1).bit_length(), 1)


@triton.jit
def bits_uniform(r):
    """kernels.philox.bits_to_uniform of uint32 Philox words."""
    x = r.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, -x - 1, x)
    return x.to(tl.float32) * 4.6566127342e-10


@triton.jit
def tl_uniform(seed, c0, c1, STREAM: tl.constexpr):
    """kernels.philox.uniform(seed, c0, c1, STREAM), bit for bit (c0, c1 wrap to 32 bits)."""
    r, _, _, _ = tl.philox(seed, c0.to(tl.uint32), c1.to(tl.uint32), STREAM, 0)
    return bits_uniform(r)


@triton.jit
def tl_vocab_uniform(seed, v0, pos, TILE: tl.constexpr, STREAM: tl.constexpr):
    """The uniforms behind kernels.philox.vocab_gumbel, bit for bit, for tokens v0 .. v0 + TILE - 1
    (v0 a multiple of 4): one Philox block per 4 tokens, its words interleaved into token order."""
    c0 = (v0 // 4 + tl.arange(0, TILE // 4)).to(tl.uint32)
    c1 = (pos + tl.zeros((TILE // 4,), tl.int64)).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, STREAM, 0)
    return bits_uniform(tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3)))


@triton.jit
def tl_vocab_gumbel(seed, v0, pos, TILE: tl.constexpr, STREAM: tl.constexpr):
    """kernels.philox.vocab_gumbel for tokens v0 .. v0 + TILE - 1 (the logs round like the
    device's, within an ulp or two of torch's)."""
    u = tl.maximum(tl_vocab_uniform(seed, v0, pos, TILE, STREAM), 1e-20)
    return -tl.log(-tl.log(u))


@triton.jit
def f32_key(x):
    """Order-preserving int32 key of finite fp32 x (-0 and +0 share the key of +0)."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def key_f32(k):
    k = k.to(tl.int32)
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def row_t(temp_ptr, r, SCALED: tl.constexpr):
    """The divisor of request r's logits when a row pass reads them unscaled (SCALED): its
    temperature, 1 for greedy rows (T <= 0), as process_logits scales them; 1.0 otherwise."""
    t = tl.full((), 1.0, tl.float32)
    if SCALED:
        t = tl.load(temp_ptr + r).to(tl.float32)
        t = tl.where(t <= 0.0, 1.0, t)
    return t


@triton.jit
def scale_z(x, t, SCALED: tl.constexpr):
    """A row pass's z from the tile it loaded: x itself (stored z), or with SCALED the logits x
    in fp32 divided by t (IEEE division, as process_logits; none at t = 1, where it is exact:
    the deployed temperature costs nothing). Applied where the tile is used, not where it is
    requested: scaled at the load, the passes that request a tile or two ahead waited for it
    there (select 176 -> 216 us at B = 64 in the rejection plan, H200)."""
    if SCALED:
        x = x.to(tl.float32)
        if t != 1.0:
            x = tl.math.div_rn(x, t)
    return x


@triton.jit
def load_z(ptr, mask, t, SCALED: tl.constexpr):
    """scale_z of a tile loaded and used at once (-inf where masked)."""
    return scale_z(tl.load(ptr, mask=mask, other=float("-inf")), t, SCALED)


@triton.jit
def d_bin(z, m, NB: tl.constexpr):
    """Histogram bin of z below the row max m (monotone in z; only used for finite z)."""
    return tl.minimum((m - z) * (NB / HIST_SPAN), NB - 1.0).to(tl.int32)


@triton.jit
def fixed_of(e, SCALE: tl.constexpr):
    """A mass e = exp(z - m) in int64 fixed point (floor of e * SCALE)."""
    return (e * SCALE).to(tl.int64)


@triton.jit
def fixed_mass(z, m, SCALE: tl.constexpr):
    """exp(z - m) as int64 fixed point (0 for -inf)."""
    return fixed_of(tl.where(z > float("-inf"), tl.exp(z - m), 0.0), SCALE)


@triton.jit
def lane_hist_add(cnt2, ms2, hit, e):
    """Add the tokens of a tile to per-lane histograms cnt2 / ms2 [TILE, NB]: hit [TILE, NB]
    says which bins each token counts in, e [TILE] its mass.

    Nothing crosses threads here: a program sums its lanes once, after its loop (a histogram
    reduced per tile costs a CTA barrier per tile, which is what bounded these passes)."""
    return cnt2 + hit.to(tl.int32), ms2 + tl.where(hit, e[:, None], 0.0)


@triton.jit
def hist_add(cnt2, ms2, j, e, valid, NB: tl.constexpr):
    """lane_hist_add of tokens in bin j in [0, NB) (valid ones only)."""
    return lane_hist_add(cnt2, ms2, (j[:, None] == tl.arange(0, NB)[None, :]) & valid[:, None], e)


@triton.jit
def hist_add_z(cnt2, ms2, z, m, NB: tl.constexpr):
    """hist_add for a tile of z (-inf: nothing) below the row max m."""
    fin = z > float("-inf")
    e = tl.where(fin, tl.exp(z - m), 0.0)
    return hist_add(cnt2, ms2, d_bin(z, m, NB), e, fin, NB)


@triton.jit
def gather_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, sel, key, w, CAP: tl.constexpr):
    """Append the selected tokens' (key, fixed mass) to row b's candidate list: a scan over the
    tile places them, and one atomic per tile that selects anything reserves their slots
    (an atomic slot per token made every tile wait on a contended round trip). ccount[b] ends
    as the number of candidates, also past CAP; their order is arbitrary, which resolve() does
    not depend on."""
    pos = tl.cumsum(sel.to(tl.int32), axis=0)
    n = tl.max(pos, axis=0)
    if n > 0:
        slot = tl.atomic_add(ccount_ptr + b, n, sem="relaxed") + pos - 1
        ok = sel & (slot < CAP)
        tl.store(ckey_ptr + b * CAP + slot, key, mask=ok)
        tl.store(cmass_ptr + b * CAP + slot, w, mask=ok)


@triton.jit
def spill(spill_ptr, pc, CHUNK, n, sel, z):
    """Append the selected z of a tile to chunk program pc's spill region, which holds n tokens
    so far (CHUNK slots: a chunk never overflows it), in token order; returns the new count.
    A scan over the tile places them: no atomics (per-token atomic slots on the program's
    counter made the select pass ~2x slower on the H200: each tile waited on its round trip)."""
    pos = tl.cumsum(sel.to(tl.int32), axis=0)
    tl.store(spill_ptr + pc.to(tl.int64) * CHUNK + n + pos - 1, z, mask=sel)
    return n + tl.max(pos, axis=0)


# Greedy rows' argmax as one atomic maximum per block (the Markov sampler's and rejection's
# greedy plans): the row's slot starts at 0 and every block maxes its packed key into it.
_NAN_KEY = tl.constexpr(2 ** 63 - 1)


@triton.jit
def pack_argmax(bmax, barg, nan):
    """int64 key whose maximum over a row's blocks is the row's greedy answer: the value first
    (order-preserving bits, offset to be non-negative: zero-filled slots are below every key),
    then the lowest id; a block holding a NaN gives the largest key."""
    hi = (f32_key(bmax).to(tl.int64) + 2147483648) << 31
    return tl.where(nan, _NAN_KEY, hi | (2147483647 - barg).to(tl.int64))


@triton.jit
def unpack_token(key):
    """The token of a packed row maximum; 0 for a degenerate row (a NaN, or a maximum that is
    not finite: all -inf, or +inf present), as argmax_tokens defines."""
    v = key_f32((key >> 31) - 2147483648)
    ok = (key != _NAN_KEY) & (v > float("-inf")) & (v < float("inf"))
    return tl.where(ok, 2147483647 - (key & 2147483647), 0)


@triton.jit
def unpack_value(key):
    """The value of a packed row maximum (NaN for a row holding a NaN)."""
    v = key_f32((key >> 31) - 2147483648)
    return tl.where(key != _NAN_KEY, v, float("nan"))


@triton.jit
def lane_argmax_update(best_v, id_v, s, offs):
    """Per-lane running argmax: a lane takes a later token only if strictly greater, so it keeps
    its lowest id on ties (no cross-thread work per tile)."""
    upd = s > best_v
    return tl.where(upd, s, best_v), tl.where(upd, offs, id_v)


@triton.jit
def lane_argmax_finish(best_v, id_v):
    """(max, lowest id reaching it) over the lanes; all -inf -> (-inf, lowest id held: 0 when
    no lane ever updated)."""
    best = tl.max(best_v, axis=0)
    return best, tl.min(tl.where(best_v == best, id_v, 2147483647), axis=0)


@triton.jit
def store_hist(hist_ptr, o, cnt, mass, NB: tl.constexpr):
    """A program's histogram at hist[o : o + 2 NB]: counts, then the masses' fp32 bits."""
    idx = tl.arange(0, NB)
    tl.store(hist_ptr + o + idx, cnt)
    tl.store(hist_ptr + o + NB + idx, mass.to(tl.int32, bitcast=True))


@triton.jit
def sum_hists(hist_ptr, o, C, NB: tl.constexpr, C_P2: tl.constexpr):
    """(counts, masses) summed over the C program histograms from hist[o] on, in a fixed order
    (read past L1: other programs wrote them). Up to 1024 / NB programs' histograms (64 at the
    default 16 bins) are requested at once, in slabs beyond that (chunk and bin knobs), so the
    registers stay bounded. A loop over the C = 16-64 programs waited on one round trip each:
    23 us per call at B = 1 on the H200."""
    SLAB: tl.constexpr = min(C_P2, max(1024 // NB, 1))
    cc = tl.arange(0, SLAB)
    idx = tl.arange(0, NB)
    tot = tl.zeros((NB,), tl.int32)
    tm = tl.zeros((NB,), tl.float32)
    for c0 in range(0, C, SLAB):
        ptrs = hist_ptr + o + (c0 + cc)[:, None] * (2 * NB) + idx[None, :]
        ok = (c0 + cc < C)[:, None]
        tot += tl.sum(tl.load(ptrs, mask=ok, other=0, cache_modifier=".cg"), axis=0)
        tm += tl.sum(tl.load(ptrs + NB, mask=ok, other=0, cache_modifier=".cg").to(
            tl.float32, bitcast=True), axis=0)
    return tot, tm


@triton.jit
def bracket(cnt, mass, k, top_p, K_ON, P_ON, NB: tl.constexpr, Z=-1.0):
    """Bin range [jlo, jhi] that holds tau, from the summed histogram: exact counts cnt [NB] and
    fp32 masses [NB] (any common unit), bins in descending z.

    K_ON / P_ON: top-k / top-p active (K_ON must already mean 0 < k <= number of finite
    tokens). A bin's true mass lies within mass * (1 -+ MASS_EPS); the range covers every bin the
    bounds allow, and resolve() checks it exactly anyway. Z >= 0: the row's total mass in the
    same unit (top-p without top-k), for a histogram that left out the tokens below a floor
    (block_max_floor); otherwise the histogram's total is the row's.
    """
    j = tl.arange(0, NB)
    hi = mass * (1.0 + MASS_EPS)
    lo = mass * (1.0 - MASS_EPS)
    CH = tl.cumsum(hi, axis=0)
    CL = tl.cumsum(lo, axis=0)
    cc = tl.cumsum(cnt, axis=0)
    jk = tl.minimum(tl.sum((cc < k).to(tl.int32), axis=0), NB - 1)
    # the top-k set's mass (the whole row without top-k): bounds
    zk_lo = tl.sum(tl.where(K_ON & (j >= jk), 0.0, lo), axis=0)
    zk_hi = tl.sum(tl.where(K_ON & (j > jk), 0.0, hi), axis=0)
    zk_lo = tl.where(Z >= 0.0, Z * (1.0 - MASS_EPS), zk_lo)
    zk_hi = tl.where(Z >= 0.0, Z * (1.0 + MASS_EPS), zk_hi)
    jp_min = tl.minimum(tl.sum((CH < top_p * zk_lo).to(tl.int32), axis=0), NB - 1)
    jp_max = tl.minimum(tl.sum((CL < top_p * zk_hi).to(tl.int32), axis=0), NB - 1)
    jp_min = tl.where(K_ON, tl.minimum(jp_min, jk), jp_min)
    jlo = tl.where(P_ON, jp_min, jk)
    jhi = tl.where(K_ON, jk, jp_max)
    return jlo, jhi


@triton.jit
def largest_key(keys, w, base, target, lo, hi, COUNT: tl.constexpr):
    """Largest key kappa in [lo, hi) with base + sum(w[keys >= kappa]) >= target (w = 1 when
    COUNT). Assumes it holds at lo; keys int32 (invalid entries below every lo), target fp64."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        sel = keys >= mid.to(tl.int32)
        if COUNT:
            f = base + tl.sum(sel.to(tl.int64), axis=0)
        else:
            f = base + tl.sum(tl.where(sel, w, 0), axis=0)
        if f.to(tl.float64) >= target:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def largest_key_pairwise(keys, w, base, target, lo, hi, COUNT: tl.constexpr):
    """largest_key() for a few candidates, in two reductions instead of up to 32 dependent ones:
    the answer is lo or a candidate's key (base + sum(w[keys >= kappa]) only changes at them),
    so each candidate's sum over the candidates at or above it is computed at once."""
    ge = keys[None, :] >= keys[:, None]                  # [i, j]: key_j >= key_i
    if COUNT:
        f = base + tl.sum(ge.to(tl.int64), axis=1)
    else:
        f = base + tl.sum(tl.where(ge, w[None, :], 0), axis=1)
    kk = keys.to(tl.int64)
    ok = (kk >= lo) & (kk < hi) & (f.to(tl.float64) >= target)
    return tl.maximum(tl.max(tl.where(ok, kk, lo), axis=0), lo)


@triton.jit
def resolve(keys, w, valid, above_m, above_c, Zf, k, top_p, K_ON, P_ON,
            SCALE: tl.constexpr, PAIRWISE: tl.constexpr = False):
    """Exact (tau, kept mass int64, ok) from the candidates and the exact mass/count above them.

    ok is False when the candidates cannot decide (the caller then uses resolve_by_scan).
    PAIRWISE: the thresholds by largest_key_pairwise (few candidates), else by bisection.
    """
    keys = tl.where(valid, keys, -2147483648)       # below the key of -FLT_MAX
    w = tl.where(valid, w, 0)
    n = tl.sum(valid.to(tl.int64), axis=0)
    kmin = tl.min(tl.where(valid, keys, 2147483647), axis=0).to(tl.int64)
    kmax = tl.max(keys, axis=0).to(tl.int64)
    ok = n > 0
    kk = kmin
    if K_ON:
        ok = ok & (above_c < k) & (above_c + n >= k)
        if PAIRWISE:
            kk = largest_key_pairwise(keys, w, above_c, k.to(tl.float64), kmin, kmax + 1, True)
        else:
            kk = largest_key(keys, w, above_c, k.to(tl.float64), kmin, kmax + 1, True)
    zk = above_m + tl.sum(tl.where(keys >= kk.to(tl.int32), w, 0), axis=0)
    kp = kk
    if P_ON:
        T = tl.where(K_ON, zk.to(tl.float64), Zf.to(tl.float64) * SCALE) * top_p.to(tl.float64)
        T = tl.maximum(T, 1.0)                  # top_p <= 0 keeps the top token(s)
        ok = ok & (above_m.to(tl.float64) < T) & (zk.to(tl.float64) >= T)
        if PAIRWISE:
            kp = largest_key_pairwise(keys, w, above_m, T, kk, kmax + 1, False)
        else:
            kp = largest_key(keys, w, above_m, T, kk, kmax + 1, False)
    kept = above_m + tl.sum(tl.where(keys >= kp.to(tl.int32), w, 0), axis=0)
    return key_f32(kp), kept, ok


@triton.jit
def scan_ge(z_ptr, V, m, kappa, t, TILE: tl.constexpr, SCALE: tl.constexpr):
    """(count, fixed mass) of the finite z = row[v] / t with key >= kappa: one row scan."""
    cnt = tl.zeros((), tl.int64)
    mass = tl.zeros((), tl.int64)
    for v0 in range(0, V, TILE):
        offs = v0 + tl.arange(0, TILE)
        z = load_z(z_ptr + offs, offs < V, t, True)
        sel = (z > float("-inf")) & (f32_key(z).to(tl.int64) >= kappa)
        cnt += tl.sum(sel.to(tl.int64), axis=0)
        mass += tl.sum(tl.where(sel, fixed_mass(z, m, SCALE), 0), axis=0)
    return cnt, mass


@triton.jit
def resolve_by_scan(z_ptr, V, m, t, Zf, k, top_p, K_ON, P_ON, TILE: tl.constexpr,
                    SCALE: tl.constexpr):
    """resolve() by bisection over the whole key range, scanning the row for every probe."""
    lo = tl.full((), -2139095040, tl.int64)     # key of -FLT_MAX: every finite z is >= it
    hi = f32_key(m).to(tl.int64) + 1
    if K_ON:
        h = hi
        while h - lo > 1:
            mid = lo + (h - lo) // 2
            c, _ = scan_ge(z_ptr, V, m, mid, t, TILE, SCALE)
            if c >= k:
                lo = mid
            else:
                h = mid
    _, zk = scan_ge(z_ptr, V, m, lo, t, TILE, SCALE)
    if P_ON:
        T = tl.where(K_ON, zk.to(tl.float64), Zf.to(tl.float64) * SCALE) * top_p.to(tl.float64)
        T = tl.maximum(T, 1.0)
        h = hi
        while h - lo > 1:
            mid = lo + (h - lo) // 2
            _, s = scan_ge(z_ptr, V, m, mid, t, TILE, SCALE)
            if s.to(tl.float64) >= T:
                lo = mid
            else:
                h = mid
    _, kept = scan_ge(z_ptr, V, m, lo, t, TILE, SCALE)
    return key_f32(lo), kept


@triton.jit
def scan_threshold(zrow, V, m, t, Zf, k, top_p, K_ON, P_ON, TILE: tl.constexpr,
                   SCALE: tl.constexpr, SCAN: tl.constexpr):
    """resolve_by_scan for a row the brackets could not decide (row zrow / t); with SCAN False
    (test hook) tau is NaN instead, so a test can prove the bracket/refinement path alone
    resolved its rows."""
    tau, kept = resolve_by_scan(zrow, V, m, t, Zf, k, top_p, K_ON, P_ON, TILE, SCALE)
    if not SCAN:
        tau = tl.full((), float("nan"), tl.float32)
    return tau, kept


@triton.jit
def store_threshold(rowf_ptr, b, tau, kept, SCALE: tl.constexpr):
    """Row b's threshold and kept mass (fixed point -> units of exp(z - max))."""
    tl.store(rowf_ptr + b * 4 + 2, tau)
    tl.store(rowf_ptr + b * 4 + 3, (kept.to(tl.float64) / SCALE).to(tl.float32))


@triton.jit
def sum_above(above_m_ptr, above_c_ptr, b, C, C_P2: tl.constexpr):
    """(fixed mass, count) of the tokens above the bracket, summed over row b's C chunk
    programs (read past L1: other programs wrote them)."""
    co = tl.arange(0, C_P2)
    cm = co < C
    am = tl.sum(tl.load(above_m_ptr + b * C + co, mask=cm, other=0, cache_modifier=".cg"), axis=0)
    ac = tl.sum(tl.load(above_c_ptr + b * C + co, mask=cm, other=0, cache_modifier=".cg"), axis=0)
    return am, ac


@triton.jit
def key_extent(kext_ptr, b, C, C_P2: tl.constexpr):
    """(lowest, highest) key of the bracket's tokens over row b's C chunk programs (int64)."""
    co = tl.arange(0, C_P2)
    cm = co < C
    kmin = tl.min(tl.load(kext_ptr + (b * C + co) * 2, mask=cm, other=2147483647,
                          cache_modifier=".cg"), axis=0)
    kmax = tl.max(tl.load(kext_ptr + (b * C + co) * 2 + 1, mask=cm, other=-2147483648,
                          cache_modifier=".cg"), axis=0)
    return kmin.to(tl.int64), kmax.to(tl.int64)


@triton.jit
def load_candidates(ckey_ptr, cmass_ptr, b, n, CAP: tl.constexpr, LOAD: tl.constexpr):
    """The first LOAD (<= CAP) of row b's n gathered candidates: (keys, fixed masses, valid)."""
    idx = tl.arange(0, LOAD)
    valid = idx < n
    keys = tl.load(ckey_ptr + b * CAP + idx, mask=valid, other=0, cache_modifier=".cg")
    w = tl.load(cmass_ptr + b * CAP + idx, mask=valid, other=0, cache_modifier=".cg")
    return keys, w, valid


# Up to this many candidates, resolve() runs pairwise (largest_key_pairwise): on peaked rows the
# bracket holds tens of tokens, and the bisection's up to 32 dependent reductions were most of
# the select pass's critical path. A power of two (0: always bisect; launch knob `few`); 32 keeps
# the select kernel at 64 registers on sm_90 (64 took it to 80: 3 programs per SM instead of 4).
FEW_CANDIDATES = 32


@triton.jit
def resolve_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, am, ac, Zf, k, top_p, K_ON, P_ON,
                       CAP: tl.constexpr, SCALE: tl.constexpr, FEW: tl.constexpr):
    """resolve() over row b's gathered candidates: (tau, kept, ok, count; the count may exceed
    CAP, the list holds the first CAP). Up to FEW (<= CAP) candidates resolve pairwise."""
    n = tl.atomic_add(ccount_ptr + b, 0, sem="acq_rel").to(tl.int64)
    # (the branches' tensors differ in size, so they must not share names)
    FL: tl.constexpr = max(FEW, 1)          # FEW = 0: only an empty list goes this way
    if n <= FEW:
        fk, fw, fv = load_candidates(ckey_ptr, cmass_ptr, b, n, CAP, FL)
        tau, kept, ok = resolve(fk, fw, fv, am, ac, Zf, k, top_p, K_ON, P_ON, SCALE, True)
    else:
        keys, w, valid = load_candidates(ckey_ptr, cmass_ptr, b, n, CAP, CAP)
        tau, kept, ok = resolve(keys, w, valid, am, ac, Zf, k, top_p, K_ON, P_ON, SCALE, False)
    return tau, kept, ok, n


# ----------------------------------------------------------------------------------------------
# Row passes shared by the fused samplers (one row = one distribution over the vocabulary)
# ----------------------------------------------------------------------------------------------
#
# Rows live in a z buffer (scaled logits, fp32; or, SCALED, the logits themselves, scaled where
# read: scale_z) with per-block statistics of z from the kernel that wrote it or read it (max,
# lowest-id argmax, sum exp(z - max), NaN flag over BLOCK_V tokens). A pass's work items are
# (row, chunk) pairs over C chunks of a row, one program each or, persistent, several items a
# program (row_list); whoever holds a row's last atomic ticket (acq_rel, after a CTA barrier;
# partials read past L1) finishes the row's work, in a fixed order: results never depend on
# which item finished first. Sampling parameters are per request: row // RPR.

@triton.jit
def tile_max(bmax_ptr, b, NBLK, v0, TILE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Max z over tokens [v0, v0 + TILE) from the logits kernel's block maxima: the sampling
    passes skip the noise (and the resample pass the reads) of tiles with nothing kept."""
    NBT: tl.constexpr = 2 * max(TILE // BLOCK_V, 1)     # a power of two >= blocks touched
    blk = v0 // BLOCK_V + tl.arange(0, NBT)
    ok = (blk <= (v0 + TILE - 1) // BLOCK_V) & (blk < NBLK)
    return tl.max(tl.load(bmax_ptr + b * NBLK + blk, mask=ok, other=float("-inf")), axis=0)


# Bisection steps of block_max_floor over HIST_SPAN nats: its bound is within 2^-10 of that
# (0.03 nats) of the tightest the block maxima give
FLOOR_STEPS = tl.constexpr(10)


@triton.jit
def block_max_floor(bm, e, m, Z, top_p):
    """A lower bound on row's top-p threshold tau from its block maxima bm (-inf: none), their
    masses e = exp(bm - m) (0 for -inf), row max m and Z = sum exp(z - m) (fp32, the one tau's
    target uses): v = m - d for the smallest d on a grid of HIST_SPAN / 2^FLOOR_STEPS nats at
    which the blocks whose maximum is >= v hold, in those maxima alone, a mass
    >= top_p * Z (1 + MASS_EPS). Each maximum is a token >= v, so
    mass(z >= v) reaches the target and tau >= v: the threshold search can leave out every token
    below v (on peaked rows, all but a few tiles of the row). -inf when m - HIST_SPAN is no such
    v. The margin covers fp32 sums; resolve() checks the result exactly anyway (a search over
    the tokens >= v that cannot reach the target falls back to the exact scan)."""
    T = top_p * Z * (1.0 + MASS_EPS)
    lo = tl.zeros((), tl.float32)
    hi = tl.zeros((), tl.float32) + HIST_SPAN
    fl = tl.full((), float("-inf"), tl.float32)
    if tl.sum(tl.where(bm >= m - hi, e, 0.0), axis=0) >= T:    # else no floor (flat rows)
        for _ in tl.static_range(FLOOR_STEPS):
            mid = (lo + hi) * 0.5
            reach = tl.sum(tl.where(bm >= m - mid, e, 0.0), axis=0) >= T
            hi = tl.where(reach, mid, hi)
            lo = tl.where(reach, lo, mid)
        fl = m - hi
    return fl


@triton.jit
def live_tiles(live_ptr, bmax_ptr, b, NBLK, lo, hi, floor, m, jhi, STEP: tl.constexpr,
               BLOCK_V: tl.constexpr, NT_P2: tl.constexpr, NB: tl.constexpr):
    """Flags (int32, one per STEP tokens of [lo, hi), at live_ptr) of the spans a row pass must
    read: those whose block maxima (blocks of BLOCK_V tokens) reach both the floor and histogram
    bin jhi below the row max m (d_bin is monotone, so a span whose maximum lies in a later bin
    holds nothing in bins <= jhi; jhi = NB - 1: no ceiling). Decided once per program and read
    back a span or two ahead of the loads they gate: a check in front of every load put a
    dependent load and a reduction there, and the passes waited on them (H200)."""
    BPT: tl.constexpr = 2 * max(STEP // BLOCK_V, 1)     # a power of two >= blocks touched
    ti = tl.arange(0, NT_P2)
    t0 = lo + ti * STEP
    blk = t0[:, None] // BLOCK_V + tl.arange(0, BPT)[None, :]
    okb = (t0[:, None] < hi) & (blk <= (t0[:, None] + STEP - 1) // BLOCK_V) & (blk < NBLK)
    tmx = tl.max(tl.load(bmax_ptr + b * NBLK + blk, mask=okb, other=float("-inf")), axis=1)
    alive = (tmx > float("-inf")) & (tmx >= floor) & (d_bin(tmx, m, NB) <= jhi)
    tl.store(live_ptr + ti, alive.to(tl.int32))
    tl.debug_barrier()          # the flags are read back by other threads


@triton.jit
def row_degenerate(nan, m):
    """A degenerate row, from its statistics: a NaN in it (nan > 0), or a maximum m that is not
    finite (all -inf, or +inf present). Reduce and the rejection plan's bound walk decide it
    alike (the walk's decision must agree with what reduce tells the later passes)."""
    return (nan > 0) | ~((m > float("-inf")) & (m < float("inf")))


# ----------------------------------------------------------------------------------------------
# Which rows a row pass works on
# ----------------------------------------------------------------------------------------------
# A gated row pass (the rejection plan's threshold searches, the Markov candidate plan's exact
# path) works on the rows a need vector flags. Launched one program per (row, chunk) item, most
# of its programs may only read their row's flag and exit: at B = 64 with no row flagged the
# Markov plan's gated launches took 3.6-7.3 us each, ~34 us a step (H200, s11_1), in waves of
# empty 8-warp programs. A persistent pass (PERSIST) instead runs a grid of about one wave
# (gated_grid) whose programs take the flagged rows' items in turn; every program ranks the
# flagged rows itself (a prefix sum over the flags: nothing has to build a list). The loop
# costs registers (GATED_PER_SM), so a pass that searches many rows (rejection's, about two
# a request) keeps one program per item: measured both ways in s11.

@triton.jit
def row_list(need_ptr, ROWS, ROWS_P2: tl.constexpr):
    """(count, rank): the rows r < ROWS (ROWS_P2 >= ROWS) whose need_ptr[r] is nonzero (the
    rejection plan's bound walk marks the rows whose exact threshold its consumers read; the
    Markov candidate plan's pick, the rows whose candidate it could not keep), and
    rank[r] = r's index among them, in row order (-1 for the others)."""
    o = tl.arange(0, ROWS_P2)
    f = (tl.load(need_ptr + o, mask=o < ROWS, other=0) != 0).to(tl.int32)
    return tl.sum(f, axis=0), tl.where(f != 0, tl.cumsum(f, axis=0) - 1, -1)


@triton.jit
def list_row(rank, i, ROWS_P2: tl.constexpr):
    """Row number i of row_list's rows."""
    return tl.sum(tl.where(rank == i, tl.arange(0, ROWS_P2), 0), axis=0)


@triton.jit
def row_needed(need_ptr, b, GATE: tl.constexpr):
    """Whether row b is worked on by a row pass launched one program per (row, chunk): always
    without GATE; with it, where need_ptr[b] != 0."""
    if GATE:
        return tl.load(need_ptr + b) != 0
    return tl.full((), 1, tl.int1)


@triton.jit
def row_flags(temp_ptr, topk_ptr, topp_ptr, b, V, MODE: tl.constexpr):
    """(greedy, k, top_p, k_on, p_on) of row b under the launch mode."""
    if MODE == 0:
        greedy = tl.full((), 1, tl.int1)
    else:
        greedy = tl.load(temp_ptr + b).to(tl.float32) <= 0.0
    k = tl.load(topk_ptr + b).to(tl.int64)
    p = tl.load(topp_ptr + b).to(tl.float32)
    if MODE == 2:
        k_on = (k > 0) & (k < V)
        p_on = p < 1.0
    else:
        k_on = tl.full((), 0, tl.int1)
        p_on = tl.full((), 0, tl.int1)
    return greedy, k, p, k_on, p_on


@triton.jit
def _reduce_item(b, c, bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr, temp_ptr, topk_ptr, topp_ptr,
                 z_ptr, drafts_ptr, prev_ptr, rowf_ptr, rowi_ptr, hist_ptr, rst_ptr, done_ptr,
                 floor_ptr, live_ptr, V, NBLK, C, CHUNK, stride_zb, stride_db, RPR, NBLK_P2,
                 TILE, NB, MODE, C_P2, BLOCK_V, NT_P2, FLOOR, SCALED, ZIN, PDL):
    """row_reduce_kernel's work item: chunk c of row b."""
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b // RPR, V, MODE)
    # only chunk 0 has work for greedy / plain rows: the others skip reading the B x NBLK block
    # statistics (16 B per block: (C - 1) x 16 KB per row and step at the Flash vocabulary)
    search = (~greedy) & (k_on | p_on)
    if (c == 0) | search:
        t = row_t(temp_ptr, b // RPR, SCALED)
        zrow = z_ptr + b.to(tl.int64) * stride_zb
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        ar = tl.arange(0, TILE)
        if MODE == 2:
            # the histogram's first two tiles, requested before the row statistics they wait for
            # (two tiles per step, the next step's two loaded before this step's are binned:
            # binning costs ~4 instructions per token and bin, and without loads in flight
            # behind it the pass waited on memory as long as it computed,
            # benchmarks/row_pass_probe.py)
            hs = tl.where(search, hi, lo)               # nothing to read without a search
            na = tl.load(zrow + lo + ar, mask=lo + ar < hs, other=float("-inf"))
            nb2 = tl.load(zrow + lo + TILE + ar, mask=lo + TILE + ar < hs, other=float("-inf"))
        o = tl.arange(0, NBLK_P2)
        om = o < NBLK
        # Z: chunk 0 stores it; the floor (top-p rows without top-k) needs it in every program.
        # Its block sums are requested with the maxima, not after them (a round trip less).
        need_z = c == 0
        if FLOOR:
            need_z = need_z | (search & p_on & (~k_on))
        bm = tl.load(bmax_ptr + b * NBLK + o, mask=om, other=float("-inf"))
        bs = tl.load(bsum_ptr + b * NBLK + o, mask=om & need_z, other=0.0)
        m = tl.max(bm, axis=0)
        nan = tl.max(tl.load(bnan_ptr + b * NBLK + o, mask=om, other=0), axis=0)
        deg = row_degenerate(nan, m)
        e = tl.zeros((NBLK_P2,), tl.float32)        # exp(block max - m)
        Z = tl.zeros((), tl.float32)
        if need_z:
            e = tl.where(bm > float("-inf"), tl.exp(bm - m), 0.0)
            if ZIN:
                Z = tl.load(rowf_ptr + b * 4 + 1)
            else:
                Z = tl.sum(bs * e, axis=0)
        if c == 0:      # Z and the argmax: only the program that stores them reads their stats
            ba = tl.load(barg_ptr + b * NBLK + o, mask=om, other=2147483647)
            arg = tl.min(tl.where(bm == m, ba, 2147483647), axis=0)
            tl.store(rowf_ptr + b * 4, m)
            tl.store(rowf_ptr + b * 4 + 1, Z)
            tl.store(rowi_ptr + b * 4 + 3, deg.to(tl.int32))
            if greedy:
                tok = tl.where(deg, 0, arg).to(tl.int64)
                tl.store(drafts_ptr + b * stride_db, tok)
                tl.store(prev_ptr + b, tok)
        if MODE == 2:
            if search & (~deg):
                fl = tl.full((), float("-inf"), tl.float32)
                if FLOOR:
                    if p_on & (~k_on):
                        fl = block_max_floor(bm, e, m, Z, p)
                if c == 0:                  # select reads it for every row it searches
                    tl.store(floor_ptr + b, fl)
                cnt2 = tl.zeros((TILE, NB), tl.int32)
                ms2 = tl.zeros((TILE, NB), tl.float32)
                if fl > float("-inf"):
                    lrow = live_ptr + (b * C + c).to(tl.int64) * NT_P2
                    live_tiles(lrow, bmax_ptr, b, NBLK, lo, hi, fl, m, NB - 1, 2 * TILE, BLOCK_V,
                               NT_P2, NB)
                    one = tl.full((), 1, tl.int32)
                    live = tl.load(lrow)        # span 0: loaded above, before fl was known
                    ln = tl.load(lrow + one, mask=one < NT_P2, other=0)
                    for v0 in range(lo, hi, 2 * TILE):
                        za = scale_z(na, t, SCALED)
                        zb = scale_z(nb2, t, SCALED)
                        cur = live
                        live = ln
                        nx = v0 + 2 * TILE + ar
                        na = tl.load(zrow + nx, mask=(nx < hi) & (ln != 0), other=float("-inf"))
                        nb2 = tl.load(zrow + nx + TILE, mask=(nx + TILE < hi) & (ln != 0),
                                      other=float("-inf"))
                        t2 = (v0 - lo) // (2 * TILE) + 2
                        ln = tl.load(lrow + t2, mask=t2 < NT_P2, other=0)
                        if cur != 0:
                            # tokens below the floor are left out (select leaves them out too)
                            za = tl.where(za >= fl, za, float("-inf"))
                            zb = tl.where(zb >= fl, zb, float("-inf"))
                            cnt2, ms2 = hist_add_z(cnt2, ms2, za, m, NB)
                            cnt2, ms2 = hist_add_z(cnt2, ms2, zb, m, NB)
                else:
                    for v0 in range(lo, hi, 2 * TILE):
                        za = scale_z(na, t, SCALED)
                        zb = scale_z(nb2, t, SCALED)
                        nx = v0 + 2 * TILE + ar
                        na = tl.load(zrow + nx, mask=nx < hi, other=float("-inf"))
                        nb2 = tl.load(zrow + nx + TILE, mask=nx + TILE < hi, other=float("-inf"))
                        cnt2, ms2 = hist_add_z(cnt2, ms2, za, m, NB)
                        cnt2, ms2 = hist_add_z(cnt2, ms2, zb, m, NB)
                pdl_release(PDL)
                cnt = tl.sum(cnt2, axis=0)
                ms = tl.sum(ms2, axis=0)
                store_hist(hist_ptr, (b * C + c) * 2 * NB, cnt, ms, NB)
                tl.debug_barrier()   # every thread's stores happen before the releasing ticket
                if tl.atomic_add(done_ptr + b, 1, sem="acq_rel") == C - 1:
                    tot, tm = sum_hists(hist_ptr, b * C * 2 * NB, C, NB, C_P2)
                    # k beyond the finite tokens: keep all
                    k_on = k_on & (k <= tl.sum(tot, axis=0))
                    # the histogram lacks the tokens below the floor: the row's Z sets the target
                    jlo, jhi = bracket(tot, tm, k, p, k_on, p_on, NB,
                                       tl.where(fl > float("-inf"), Z, -1.0))
                    jj = tl.arange(0, NB)
                    # the bracket's exact token count: select gathers only what fits CAP
                    n_in = tl.sum(tl.where((jj >= jlo) & (jj <= jhi), tot, 0), axis=0)
                    tl.store(rst_ptr + b * 4 + 3, n_in)
                    tl.store(rowi_ptr + b * 4, jlo)
                    tl.store(rowi_ptr + b * 4 + 1, jhi)
                    tl.store(rowi_ptr + b * 4 + 2, k_on.to(tl.int32))


@triton.jit
def row_reduce_kernel(bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr, temp_ptr, topk_ptr, topp_ptr,
                      z_ptr, drafts_ptr, prev_ptr, rowf_ptr, rowi_ptr, hist_ptr, rst_ptr, done_ptr,
                      floor_ptr, live_ptr, need_ptr, V, NBLK, C, CHUNK, stride_zb, stride_db, z_off,
                      step, done_off, RPR, ROWS, NBLK_P2: tl.constexpr, TILE: tl.constexpr,
                      NB: tl.constexpr, MODE: tl.constexpr, C_P2: tl.constexpr = 1,
                      BLOCK_V: tl.constexpr = 1,
                      NT_P2: tl.constexpr = 1, FLOOR: tl.constexpr = False,
                      GATE: tl.constexpr = False, SCALED: tl.constexpr = False,
                      ZIN: tl.constexpr = False, ROWS_P2: tl.constexpr = 1,
                      PERSIST: tl.constexpr = False,
                      PDL: tl.constexpr = 0):
    # FLOOR: top-p rows (without top-k) leave out the tokens below block_max_floor, and the
    # spans of 2 TILE tokens that hold none are neither read nor binned; select does the same
    # (the floor goes to floor_ptr[b], which select reads). BLOCK_V: the statistics' blocks.
    # Work items: (row b, chunk c). GATE: only the rows need_ptr flags. PERSIST: a grid of any
    # size whose programs take the items of the flagged rows among ROWS (ROWS_P2 >= ROWS) in
    # turn (row_list); a program's pdl_release then comes after its first item's main loop (as
    # measured, s11_3), so with PDL 2 the next launch may start while programs still hold
    # items (it waits for this grid's end in pdl_enter all the same). Else grid (rows, C), one
    # program per item. SCALED: z_ptr holds the logits, scaled where each tile is used
    # (scale_z; the statistics came from the same z).
    # ZIN: Z is read from rowf_ptr[b, 1], where an earlier launch of the caller wrote it from the
    # same statistics (the Markov candidate plan's rowstat, whose pick decided with that Z: the
    # threshold search must use its bits, not a sum that may round otherwise).
    pdl_enter(PDL)
    z_ptr += z_off
    drafts_ptr += step
    done_ptr += done_off
    if PERSIST:
        tl.static_assert(GATE, "a persistent pass takes the rows need_ptr flags")
        count, rank = row_list(need_ptr, ROWS, ROWS_P2)
        for item in range(tl.program_id(0), count * C, tl.num_programs(0)):
            _reduce_item(list_row(rank, item // C, ROWS_P2), item % C, bmax_ptr, barg_ptr,
                bsum_ptr, bnan_ptr, temp_ptr, topk_ptr, topp_ptr, z_ptr, drafts_ptr, prev_ptr,
                rowf_ptr, rowi_ptr, hist_ptr, rst_ptr, done_ptr, floor_ptr, live_ptr, V, NBLK, C,
                CHUNK, stride_zb, stride_db, RPR, NBLK_P2, TILE, NB, MODE, C_P2, BLOCK_V,
                NT_P2, FLOOR, SCALED, ZIN, PDL)
    else:
        b = tl.program_id(0)
        if row_needed(need_ptr, b, GATE):
            _reduce_item(b, tl.program_id(1), bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr, temp_ptr,
                topk_ptr, topp_ptr, z_ptr, drafts_ptr, prev_ptr, rowf_ptr, rowi_ptr, hist_ptr,
                rst_ptr, done_ptr, floor_ptr, live_ptr, V, NBLK, C, CHUNK, stride_zb, stride_db,
                RPR, NBLK_P2, TILE, NB, MODE, C_P2, BLOCK_V, NT_P2, FLOOR, SCALED, ZIN, PDL)


@triton.jit
def _select_tile(z, m, jlo, jhi, nb, b, C, c, CHUNK, am_v, ac_v, kmin_v, kmax_v, n_sp,
                 ccount_ptr, ckey_ptr, cmass_ptr, spill_ptr, fl, NB: tl.constexpr,
                 CAP: tl.constexpr, SCALE: tl.constexpr):
    """One tile of row_select_kernel: the exact mass / count above the bracket into the lane
    partials, the bracket's tokens into the candidates (or, overflowing, the spill region).
    Tokens below the floor fl (reduce's block_max_floor, or -inf) are left out, as reduce's
    histogram left them out."""
    fin = (z > float("-inf")) & (z >= fl)
    j = d_bin(z, m, NB)
    above = fin & (j < jlo)
    cand = fin & (j >= jlo) & (j <= jhi)
    w = fixed_mass(z, m, SCALE)
    am_v += tl.where(above, w, 0)
    ac_v += above.to(tl.int32)
    key = f32_key(z)
    if nb <= CAP:
        gather_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, cand, key, w, CAP)
    else:
        # overflow: refine reads the bracket from this program's spill region (a fraction of
        # the chunk) instead of the row, and needs its key range
        kmin_v = tl.minimum(kmin_v, tl.where(cand, key, 2147483647))
        kmax_v = tl.maximum(kmax_v, tl.where(cand, key, -2147483648))
        n_sp = spill(spill_ptr, b * C + c, CHUNK, n_sp, cand, z)
    return am_v, ac_v, kmin_v, kmax_v, n_sp


@triton.jit
def _select_item(b, c, temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr, rowi_ptr, above_m_ptr,
                 above_c_ptr, rowa_ptr, ckey_ptr, cmass_ptr, ccount_ptr, done_ptr, kext_ptr,
                 rst_ptr, spill_ptr, spn_ptr, bmax_ptr, live_ptr, floor_ptr, V, C, CHUNK, NBLK,
                 stride_zb, RPR, TILE, NB, CAP, SCALE, C_P2, BLOCK_V, NT_P2, SKIP, FEW, SCAN,
                 SCALED, PDL):
    """row_select_kernel's work item: chunk c of row b."""
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b // RPR, V, 2)
    search = (~greedy) & (k_on | p_on)
    deg = tl.load(rowi_ptr + b * 4 + 3, mask=search, other=1) != 0
    if search & (~deg):
        k_on = tl.load(rowi_ptr + b * 4 + 2) != 0
        if (~k_on) & (~p_on):
            # top-k beyond the finite tokens (reduce turned it off) and no top-p: every finite
            # token is kept, so there is nothing to search
            if c == 0:
                tl.store(rowf_ptr + b * 4 + 2, float("-inf"))
                tl.store(rowf_ptr + b * 4 + 3, tl.load(rowf_ptr + b * 4 + 1))
        else:
            jlo = tl.load(rowi_ptr + b * 4)
            jhi = tl.load(rowi_ptr + b * 4 + 1)
            m = tl.load(rowf_ptr + b * 4)
            Z = tl.load(rowf_ptr + b * 4 + 1)
            nb = tl.load(rst_ptr + b * 4 + 3)     # tokens in the bracket (exact, from reduce)
            fl = tl.load(floor_ptr + b)           # reduce's block_max_floor (or -inf)
            t = row_t(temp_ptr, b // RPR, SCALED)
            zrow = z_ptr + b.to(tl.int64) * stride_zb
            # per-lane partials over the chunk, reduced once at the end (no per-tile barriers)
            am_v = tl.zeros((TILE,), tl.int64)               # exact fixed mass above the bracket
            ac_v = tl.zeros((TILE,), tl.int32)
            kmin_v = tl.full((TILE,), 2147483647, tl.int32)   # key range of the candidates
            kmax_v = tl.full((TILE,), -2147483648, tl.int32)
            n_sp = tl.zeros((), tl.int32)                      # tokens spilled (overflow)
            # The next tile is loaded before this one is used. Tiles wholly below the bracket
            # hold nothing select needs; on peaked rows that is most of the row. Their flags
            # (live_tiles) are read one per tile, two ahead.
            lo = c * CHUNK
            hi = tl.minimum(lo + CHUNK, V)
            ar = tl.arange(0, TILE)
            lrow = live_ptr + (b * C + c).to(tl.int64) * NT_P2
            if SKIP:
                live_tiles(lrow, bmax_ptr, b, NBLK, lo, hi, fl, m, jhi, TILE, BLOCK_V, NT_P2, NB)
                one = tl.full((), 1, tl.int32)
                ln = tl.load(lrow)
                lnn = tl.load(lrow + one, mask=one < NT_P2, other=0)
            else:
                ln = tl.full((), 1, tl.int32)
                lnn = tl.full((), 1, tl.int32)
            zn = tl.load(zrow + lo + ar, mask=(lo + ar < hi) & (ln != 0), other=float("-inf"))
            for v0 in range(lo, hi, TILE):
                z = zn
                live = ln
                ln = lnn
                nx = v0 + TILE + ar
                zn = tl.load(zrow + nx, mask=(nx < hi) & (ln != 0), other=float("-inf"))
                if SKIP:
                    t2 = (v0 - lo) // TILE + 2
                    lnn = tl.load(lrow + t2, mask=t2 < NT_P2, other=0)
                if live != 0:
                    am_v, ac_v, kmin_v, kmax_v, n_sp = _select_tile(
                        scale_z(z, t, SCALED), m, jlo, jhi, nb, b, C, c, CHUNK, am_v, ac_v,
                        kmin_v, kmax_v,
                        n_sp, ccount_ptr, ckey_ptr, cmass_ptr, spill_ptr, fl, NB, CAP, SCALE)
            pdl_release(PDL)
            tl.store(above_m_ptr + b * C + c, tl.sum(am_v, axis=0))
            tl.store(above_c_ptr + b * C + c, tl.sum(ac_v.to(tl.int64), axis=0))
            tl.store(kext_ptr + (b * C + c) * 2, tl.min(kmin_v, axis=0))
            tl.store(kext_ptr + (b * C + c) * 2 + 1, tl.max(kmax_v, axis=0))
            tl.store(spn_ptr + b * C + c, n_sp)
            tl.debug_barrier()
            if tl.atomic_add(done_ptr + b, 1, sem="acq_rel") == C - 1:
                if nb > CAP:
                    # overflow: the candidates are exactly the tokens with key in [kmin, kmax];
                    # row_refine_kernel narrows that range (and resolves tau)
                    kmin, kmax = key_extent(kext_ptr, b, C, C_P2)
                    am, ac = sum_above(above_m_ptr, above_c_ptr, b, C, C_P2)
                    tl.store(rowa_ptr + b * 2, am)         # refine sees only the spilled tokens
                    tl.store(rowa_ptr + b * 2 + 1, ac)
                    tl.store(rst_ptr + b * 4 + 1, kmin.to(tl.int32))
                    tl.store(rst_ptr + b * 4 + 2, kmax.to(tl.int32))
                    tl.store(rst_ptr + b * 4, tl.where(kmin == kmax, 2, 1))
                else:
                    am, ac = sum_above(above_m_ptr, above_c_ptr, b, C, C_P2)
                    tau, kept, ok, n = resolve_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, am,
                                                          ac, Z, k, p, k_on, p_on, CAP, SCALE,
                                                          FEW)
                    ok = ok & (n == nb)      # every candidate gathered (reduce's count holds)
                    if ~ok:
                        tau, kept = scan_threshold(zrow, V, m, t, Z, k, p, k_on, p_on, TILE, SCALE,
                                                   SCAN)
                    store_threshold(rowf_ptr, b, tau, kept, SCALE)


@triton.jit
def row_select_kernel(temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr, rowi_ptr, above_m_ptr,
                      above_c_ptr, rowa_ptr, ckey_ptr, cmass_ptr, ccount_ptr, done_ptr, kext_ptr,
                      rst_ptr, spill_ptr, spn_ptr, bmax_ptr, live_ptr, floor_ptr, need_ptr, V, C,
                      CHUNK, NBLK, stride_zb, z_off, ccount_off, done_off, RPR, ROWS,
                      TILE: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr,
                      SCALE: tl.constexpr, C_P2: tl.constexpr, BLOCK_V: tl.constexpr,
                      NT_P2: tl.constexpr, SKIP: tl.constexpr, FEW: tl.constexpr,
                      SCAN: tl.constexpr = True, GATE: tl.constexpr = False,
                      SCALED: tl.constexpr = False, ROWS_P2: tl.constexpr = 1,
                      PERSIST: tl.constexpr = False,
                      PDL: tl.constexpr = 0):
    # SCAN: the scan_threshold test hook. SKIP: tiles whose block maxima (bmax, the statistics
    # pass's blocks of BLOCK_V tokens) lie below the bracket are neither read nor binned.
    # Work items, GATE, PERSIST, SCALED: as in row_reduce_kernel (refine takes the same flags:
    # a row select skips keeps refine state 0)
    pdl_enter(PDL)
    z_ptr += z_off
    ccount_ptr += ccount_off
    done_ptr += done_off
    if PERSIST:
        tl.static_assert(GATE, "a persistent pass takes the rows need_ptr flags")
        count, rank = row_list(need_ptr, ROWS, ROWS_P2)
        for item in range(tl.program_id(0), count * C, tl.num_programs(0)):
            _select_item(list_row(rank, item // C, ROWS_P2), item % C, temp_ptr, topk_ptr,
                topp_ptr, z_ptr, rowf_ptr, rowi_ptr, above_m_ptr, above_c_ptr, rowa_ptr, ckey_ptr,
                cmass_ptr, ccount_ptr, done_ptr, kext_ptr, rst_ptr, spill_ptr, spn_ptr, bmax_ptr,
                live_ptr, floor_ptr, V, C, CHUNK, NBLK, stride_zb, RPR, TILE, NB, CAP, SCALE,
                C_P2, BLOCK_V, NT_P2, SKIP, FEW, SCAN, SCALED, PDL)
    else:
        b = tl.program_id(0)
        if row_needed(need_ptr, b, GATE):
            _select_item(b, tl.program_id(1), temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr,
                rowi_ptr, above_m_ptr, above_c_ptr, rowa_ptr, ckey_ptr, cmass_ptr, ccount_ptr,
                done_ptr, kext_ptr, rst_ptr, spill_ptr, spn_ptr, bmax_ptr, live_ptr, floor_ptr, V,
                C, CHUNK, NBLK, stride_zb, RPR, TILE, NB, CAP, SCALE, C_P2, BLOCK_V, NT_P2, SKIP,
                FEW, SCAN, SCALED, PDL)


# ----------------------------------------------------------------------------------------------
# Refinement of an overflowing bracket (radix-select style, exact)
# ----------------------------------------------------------------------------------------------
#
# Near-flat rows (top-p 0.95 over a flat-ish distribution) put more than CAP tokens in the
# first bracket (one 2-nat bin holds ~10^4 tokens at the Flash vocabulary). The select pass then
# records the bracket's exact key range [klo, khi] (fp32 order keys; candidates are exactly the
# finite tokens with key in it, since bins are monotone in z), the exact mass/count above it
# (rowa), and spills the bracket's z values into its chunk's spill region (`spill`: CHUNK slots
# per chunk program, so it cannot overflow). Each refine pass reads only the spill regions -- a
# tenth of the row on the benchmark's rows, less on peaked ones -- not the row:
#   HIST:   sums the exact fixed-point mass/count above khi (plus rowa), and for NB fp32 edges
#           splitting the bracket's value range evenly, the count and fp32 mass of its tokens
#           above each edge; its last program narrows [klo, khi] to the edge interval(s) that
#           hold tau;
#   GATHER: once the bracket holds <= CAP tokens (or a single key), collects them and resolves
#           tau exactly as the select pass does.
# Spilled tokens outside the current [klo, khi] (narrowed away by an earlier pass) are read and
# skipped. Edges are explicit fp32 values and membership is a comparison, so an interval is
# exactly a key range (even across zero, where key-space bins of equal width would hold nearly
# every token). Each HIST pass narrows the bracket ~NB-fold in value. Row state (rst): [state
# (0 done, 1 HIST, 2 GATHER), klo, khi, tokens in the select bracket]. Bounds only decide which
# tokens are gathered: resolve() verifies the bracket with exact sums, and anything it cannot
# decide (or a row still unresolved after the last pass) takes resolve_by_scan: exact always.

REFINE_PASSES = 3


@triton.jit
def refine_edges(klo, khi, NB: tl.constexpr):
    """NB descending fp32 edges splitting [key_f32(klo), key_f32(khi)] into even intervals
    (interval i: t[i] < z <= t[i - 1]); the last edge is -inf, so it takes the rest."""
    zlo = key_f32(klo)
    zhi = key_f32(khi)
    i = tl.arange(0, NB)
    w = zhi / NB - zlo / NB                     # no overflow for any finite pair
    t = zhi - (i + 1).to(tl.float32) * w
    return tl.where(i == NB - 1, float("-inf"), t)


@triton.jit
def edge_bracket(cg, mg, t, klo, khi, am, ac, Zf, k, top_p, K_ON, P_ON,
                 NB: tl.constexpr, SCALE: tl.constexpr):
    """(klo', khi', n') from the bracket tokens' counts cg [NB] and fp32 masses mg [NB] (units of
    exp(z - max)) above each edge t [NB], and the exact fixed mass am / count ac of the tokens
    above khi. Same logic as bracket(), on cumulative sums and in fixed-point units (a token's
    fixed mass is floor(e * SCALE): up to one unit below e * SCALE). Without top-k the target is
    top_p times the whole row's mass Zf (the edges only cover the bracket)."""
    i = tl.arange(0, NB)
    msc = mg.to(tl.float64) * SCALE
    A = am.to(tl.float64)
    CH = A + msc * (1.0 + MASS_EPS)
    CL = A + tl.maximum(msc * (1.0 - MASS_EPS) - cg.to(tl.float64), 0.0)
    cc = ac + cg.to(tl.int64)
    ik = tl.minimum(tl.sum((cc < k).to(tl.int32), axis=0), NB - 1)
    zrow = Zf.to(tl.float64) * SCALE
    zk_lo = tl.where(K_ON, tl.max(tl.where(i < ik, CL, A), axis=0), zrow * (1.0 - MASS_EPS))
    zk_hi = tl.where(K_ON, tl.max(tl.where(i <= ik, CH, A), axis=0), zrow * (1.0 + MASS_EPS))
    p = top_p.to(tl.float64)
    t_lo = tl.maximum(zk_lo * p, 1.0)
    t_hi = tl.maximum(zk_hi * p, 1.0)
    ip_min = tl.minimum(tl.sum((CH < t_lo).to(tl.int32), axis=0), NB - 1)
    ip_max = tl.minimum(tl.sum((CL < t_hi).to(tl.int32), axis=0), NB - 1)
    ip_min = tl.where(K_ON, tl.minimum(ip_min, ik), ip_min)
    jlo = tl.where(P_ON, ip_min, ik)
    jhi = tl.where(K_ON, ik, ip_max)
    below = tl.sum(tl.where(i == jlo - 1, cg, 0), axis=0)          # 0 when jlo == 0
    n = tl.sum(tl.where(i == jhi, cg, 0), axis=0) - below
    t_top = tl.max(tl.where(i == jlo - 1, t, float("-inf")), axis=0)
    t_bot = tl.max(tl.where(i == jhi, t, float("-inf")), axis=0)
    nkhi = tl.where(jlo == 0, khi, f32_key(t_top).to(tl.int64))
    nklo = tl.where(jhi == NB - 1, klo, f32_key(t_bot).to(tl.int64) + 1)
    return nklo, nkhi, n.to(tl.int64)


@triton.jit
def resolve_one_key(key, n, am, ac, m, Zf, k, top_p, K_ON, P_ON, SCALE: tl.constexpr):
    """resolve() for n > CAP candidates that all share one key (exact ties)."""
    z = key_f32(key)
    zk = am + n * fixed_mass(z, m, SCALE)
    ok = n > 0
    if K_ON:
        ok = ok & (ac < k) & (ac + n >= k)
    if P_ON:
        T = tl.where(K_ON, zk.to(tl.float64), Zf.to(tl.float64) * SCALE) * top_p.to(tl.float64)
        T = tl.maximum(T, 1.0)
        ok = ok & (am.to(tl.float64) < T) & (zk.to(tl.float64) >= T)
    return z, zk, ok


@triton.jit
def _refine_item(b, c, temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr, rowi_ptr, rst_ptr,
                 above_m_ptr, above_c_ptr, rowa_ptr, hist_ptr, kext_ptr, spill_ptr, spn_ptr,
                 ckey_ptr, cmass_ptr, ccount_ptr, done_ptr, V, C, CHUNK, stride_zb, RPR, LAST,
                 TILE, NB, CAP, SCALE, C_P2, FEW, SCAN, SCALED, PDL):
    """row_refine_kernel's work item: chunk c of row b (its spill region)."""
    state = tl.load(rst_ptr + b * 4)
    if state != 0:
        _, k, p, _, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b // RPR, V, 2)
        k_on = tl.load(rowi_ptr + b * 4 + 2) != 0
        klo = tl.load(rst_ptr + b * 4 + 1).to(tl.int64)
        khi = tl.load(rst_ptr + b * 4 + 2).to(tl.int64)
        m = tl.load(rowf_ptr + b * 4)
        Z = tl.load(rowf_ptr + b * 4 + 1)
        zrow = z_ptr + b.to(tl.int64) * stride_zb
        t = row_t(temp_ptr, b // RPR, SCALED)
        te = refine_edges(klo, khi, NB)
        # this program's spill region: the select bracket's tokens of its chunk (every token
        # of the current bracket, and those the earlier passes narrowed away)
        pc = (b * C + c).to(tl.int64)
        n_c = tl.load(spn_ptr + pc)
        src = spill_ptr + pc * CHUNK
        ar = tl.arange(0, TILE)
        # per-lane partials over the region, reduced once at the end (no per-tile barriers)
        am_v = tl.zeros((TILE,), tl.int64)                 # exact fixed mass above khi
        ac_v = tl.zeros((TILE,), tl.int32)
        kmin_v = tl.full((TILE,), 2147483647, tl.int32)    # actual key range inside the bracket
        kmax_v = tl.full((TILE,), -2147483648, tl.int32)
        cg2 = tl.zeros((TILE, NB), tl.int32)               # bracket tokens above each edge
        mg2 = tl.zeros((TILE, NB), tl.float32)
        zn = tl.load(src + ar, mask=ar < n_c, other=float("-inf"))
        for v0 in range(0, n_c, TILE):
            z = zn
            zn = tl.load(src + v0 + TILE + ar, mask=v0 + TILE + ar < n_c, other=float("-inf"))
            fin = z > float("-inf")
            key = f32_key(z)
            above = fin & (key > khi)
            inb = fin & (key >= klo) & (key <= khi)
            e = tl.where(fin, tl.exp(z - m), 0.0)
            w = fixed_of(e, SCALE)
            am_v += tl.where(above, w, 0)
            ac_v += above.to(tl.int32)
            if state == 1:
                hit = (z[:, None] > te[None, :]) & inb[:, None]
                cg2, mg2 = lane_hist_add(cg2, mg2, hit, e)
                kmin_v = tl.minimum(kmin_v, tl.where(inb, key, 2147483647))
                kmax_v = tl.maximum(kmax_v, tl.where(inb, key, -2147483648))
            else:
                gather_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, inb, key, w, CAP)
        pdl_release(PDL)
        tl.store(above_m_ptr + b * C + c, tl.sum(am_v, axis=0))
        tl.store(above_c_ptr + b * C + c, tl.sum(ac_v.to(tl.int64), axis=0))
        if state == 1:
            store_hist(hist_ptr, (b * C + c) * 2 * NB, tl.sum(cg2, axis=0), tl.sum(mg2, axis=0),
                       NB)
            tl.store(kext_ptr + (b * C + c) * 2, tl.min(kmin_v, axis=0))
            tl.store(kext_ptr + (b * C + c) * 2 + 1, tl.max(kmax_v, axis=0))
        tl.debug_barrier()
        if tl.atomic_add(done_ptr + b, 1, sem="acq_rel") == C - 1:
            am, ac = sum_above(above_m_ptr, above_c_ptr, b, C, C_P2)
            am += tl.load(rowa_ptr + b * 2)          # the tokens above the select bracket
            ac += tl.load(rowa_ptr + b * 2 + 1)
            finish = (state != 1) | (LAST != 0)
            tau = tl.zeros((), tl.float32)
            kept = tl.zeros((), tl.int64)
            if state == 1:
                tot, tm = sum_hists(hist_ptr, b * C * 2 * NB, C, NB, C_P2)
                kmin, kmax = key_extent(kext_ptr, b, C, C_P2)
                nklo, nkhi, n = edge_bracket(tot, tm, te, klo, khi, am, ac, Z, k, p, k_on, p_on,
                                             NB, SCALE)
                # no token of the bracket lies outside [kmin, kmax]: the same set, fewer keys
                nklo = tl.maximum(nklo, kmin)
                nkhi = tl.minimum(nkhi, kmax)
                tl.store(rst_ptr + b * 4 + 1, nklo.to(tl.int32))
                tl.store(rst_ptr + b * 4 + 2, nkhi.to(tl.int32))
                tl.store(rst_ptr + b * 4, tl.where((n <= CAP) | (nklo == nkhi), 2, 1))
                if kmin == kmax:
                    # the whole bracket is one value (exact ties): resolved here, exactly
                    finish = kmin == kmax
                    tau, kept, ok = resolve_one_key(kmin, tl.max(tot, axis=0).to(tl.int64), am,
                                                    ac, m, Z, k, p, k_on, p_on, SCALE)
                    if ~ok:
                        tau, kept = scan_threshold(zrow, V, m, t, Z, k, p, k_on, p_on, TILE, SCALE,
                                                   SCAN)
                elif LAST != 0:
                    tau, kept = scan_threshold(zrow, V, m, t, Z, k, p, k_on, p_on, TILE,
                                               SCALE, SCAN)
            else:
                tau, kept, ok, n = resolve_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, am, ac,
                                                      Z, k, p, k_on, p_on, CAP, SCALE, FEW)
                if n > CAP:
                    tau, kept, ok = resolve_one_key(klo, n, am, ac, m, Z, k, p, k_on, p_on,
                                                    SCALE)
                    ok = ok & (klo == khi)
                if ~ok:
                    tau, kept = scan_threshold(zrow, V, m, t, Z, k, p, k_on, p_on, TILE,
                                               SCALE, SCAN)
            if finish:
                tl.store(rst_ptr + b * 4, 0)
                store_threshold(rowf_ptr, b, tau, kept, SCALE)


@triton.jit
def row_refine_kernel(temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr, rowi_ptr, rst_ptr,
                      above_m_ptr, above_c_ptr, rowa_ptr, hist_ptr, kext_ptr, spill_ptr, spn_ptr,
                      ckey_ptr, cmass_ptr, ccount_ptr, done_ptr, need_ptr, V, C, CHUNK,
                      stride_zb, z_off, ccount_off, done_off, RPR, ROWS, LAST,
                      TILE: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr,
                      SCALE: tl.constexpr, C_P2: tl.constexpr, FEW: tl.constexpr,
                      SCAN: tl.constexpr = True, GATE: tl.constexpr = False,
                      SCALED: tl.constexpr = False, ROWS_P2: tl.constexpr = 1,
                      PERSIST: tl.constexpr = False,
                      PDL: tl.constexpr = 0):
    # Work items, GATE, PERSIST: as in row_select_kernel (rows select resolved or skipped have
    # state 0).
    # SCALED: as in row_reduce_kernel (only the scan fallback reads the row; the spill regions
    # hold scaled z)
    pdl_enter(PDL)
    z_ptr += z_off
    ccount_ptr += ccount_off
    done_ptr += done_off
    if PERSIST:
        tl.static_assert(GATE, "a persistent pass takes the rows need_ptr flags")
        count, rank = row_list(need_ptr, ROWS, ROWS_P2)
        for item in range(tl.program_id(0), count * C, tl.num_programs(0)):
            _refine_item(list_row(rank, item // C, ROWS_P2), item % C, temp_ptr, topk_ptr,
                topp_ptr, z_ptr, rowf_ptr, rowi_ptr, rst_ptr, above_m_ptr, above_c_ptr, rowa_ptr,
                hist_ptr, kext_ptr, spill_ptr, spn_ptr, ckey_ptr, cmass_ptr, ccount_ptr, done_ptr,
                V, C, CHUNK, stride_zb, RPR, LAST, TILE, NB, CAP, SCALE, C_P2, FEW, SCAN, SCALED,
                PDL)
    else:
        b = tl.program_id(0)
        if row_needed(need_ptr, b, GATE):
            _refine_item(b, tl.program_id(1), temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr,
                rowi_ptr, rst_ptr, above_m_ptr, above_c_ptr, rowa_ptr, hist_ptr, kext_ptr,
                spill_ptr, spn_ptr, ckey_ptr, cmass_ptr, ccount_ptr, done_ptr, V, C, CHUNK,
                stride_zb, RPR, LAST, TILE, NB, CAP, SCALE, C_P2, FEW, SCAN, SCALED, PDL)


# ----------------------------------------------------------------------------------------------
# Launching the threshold search's select and refine passes (both fused samplers use this)
# ----------------------------------------------------------------------------------------------

# Programs per SM of a persistent pass's grid (gated_grid), per compute capability major: what
# the PERSIST build keeps resident at its registers, so the grid is one wave and a launch with
# nothing flagged costs one wave of empty programs. The item loop costs registers (LLVM hoists
# the per-thread address arithmetic of the whole body out of it): on sm_90 reduce 128-137
# (3 CTAs of 4 warps per SM), select 128 (2 of 8 warps), refine 215 (1 of 8 warps), against
# 89 / 74 / 97 one program per item (benchmarks/kernel_resources.py --capability 90; the H200
# A/B of s11_3 ran these). On sm_120 / sm_121 the 16-row select build takes more registers:
# 1 per SM (tests/kernels/test_sm12x_resources.py checks the declared builds fit). The count
# varies with ROWS_P2 (a select build for 1 row took 198), so a row count not declared may fit
# fewer: its grid then runs in two waves, slower, not wrong. Other capabilities (and the
# interpreter) take SM12x's table.
GATED_PER_SM = {9: {"reduce": 3, "select": 2, "refine": 1},
                12: {"reduce": 3, "select": 1, "refine": 1}}


def gated_per_sm(kind: str, device) -> int:
    """GATED_PER_SM's programs per SM for pass `kind` (reduce / select / refine) on `device`."""
    device = torch.device(device)
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 12
    return GATED_PER_SM.get(major, GATED_PER_SM[12])[kind]


def gated_grid(rows: int, C: int, per_sm: int, device, persist: bool) -> tuple:
    """Grid of a row pass over `rows` rows of C chunk programs: one program per (row, chunk)
    item, (rows, C); persistent (PERSIST, a gated pass whose flagged rows are usually few) at
    most per_sm programs per SM, which take the flagged rows' items in turn (row_list)."""
    if not persist:
        return (rows, C)
    return (max(1, min(rows * C, per_sm * multiprocessors(device))),)


def row_list_p2(rows: int, persist: bool) -> int:
    """ROWS_P2 of a row pass over `rows` rows: the need flags' vector of a persistent gated
    pass (row_list), 1 otherwise."""
    return next_pow2(rows) if persist else 1


def check_int32_index(**tensors) -> None:
    """The fused kernels index rows and vocabulary with int32 arithmetic: a tensor spanning 2^31
    or more elements (its element count, or its largest offset for a strided view) would wrap
    silently, so the launchers refuse it, naming the tensor."""
    for name, t in tensors.items():
        span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        if max(t.numel(), span) >= 2 ** 31:
            raise ValueError(f"{name} spans {max(t.numel(), span)} elements ({tuple(t.shape)}, "
                             f"strides {t.stride()}); the fused kernels index at most 2^31 - 1 "
                             f"(split the batch)")


def check_pow2(name: str, value, lo: int, hi: int) -> None:
    """A launch knob that must be a power of two in [lo, hi]."""
    if not isinstance(value, int) or value < lo or value > hi or value & (value - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {value!r}")


def live_slots(CHUNK: int, TILE: int, nb: int = HIST_BINS) -> int:
    """Span flags per row-pass program (a power of two >= select's tiles and reduce's spans of
    2 hist_tile tokens)."""
    return next_pow2(max(CHUNK // select_tile(TILE), triton.cdiv(CHUNK, 2 * hist_tile(TILE, nb))))


def threshold_scratch(rows: int, C: int, CHUNK: int, cap: int, nb: int, edges: int, dev,
                      TILE: int):
    """Scratch of the select/refine passes for `rows` rows in C chunk programs (uninitialised:
    every slot is written before it is read)."""
    i32, i64 = torch.int32, torch.int64
    return dict(
        live=torch.empty((rows, C, live_slots(CHUNK, TILE, nb)), dtype=i32, device=dev),
        floor=torch.empty((rows,), dtype=torch.float32, device=dev),
        hist=torch.empty((rows, C, 2 * max(nb, edges)), dtype=i32, device=dev),
        kext=torch.empty((rows, C, 2), dtype=i32, device=dev),
        above_m=torch.empty((rows, C), dtype=i64, device=dev),
        above_c=torch.empty((rows, C), dtype=i64, device=dev),
        rowa=torch.empty((rows, 2), dtype=i64, device=dev),
        ckey=torch.empty((rows, cap), dtype=i32, device=dev),
        cmass=torch.empty((rows, cap), dtype=i64, device=dev),
        # the overflowing brackets' tokens, per chunk program (rows x V fp32 at most)
        spill=torch.empty((rows, C, CHUNK), dtype=torch.float32, device=dev),
        spn=torch.empty((rows, C), dtype=i32, device=dev))


def reduce_compile_config(TILE: int, CHUNK: int, C: int, BLOCK_V: int, V: int, mode: int,
                          pdl: int = 0, gate: bool = False, scaled: bool = False,
                          zin: bool = False, rows: int = 1, persist: bool = False):
    """row_reduce_kernel's compile entry for a launch at row tile TILE, C chunk programs of CHUNK
    tokens, statistics blocks of BLOCK_V, vocabulary V, MODE mode (2: with the threshold
    histogram and the floor); `gate`, `scaled`, `zin`: only rows need flags mark (of `rows`),
    unscaled logits read, Z given (the rejection plan and the Markov candidate plan); `persist`
    (with `gate`): the persistent build (PERSIST), whose need-flag vector `rows` sizes."""
    d16 = "i32:16"
    return compile_config(row_reduce_kernel, dict(
        bmax_ptr="*fp32", barg_ptr="*i32", bsum_ptr="*fp32", bnan_ptr="*i32", temp_ptr="*fp32",
        topk_ptr="*i64", topp_ptr="*fp32", z_ptr="*fp32", drafts_ptr="*i64", prev_ptr="*i64",
        rowf_ptr="*fp32", rowi_ptr="*i32", hist_ptr="*i32", rst_ptr="*i32", done_ptr="*i32",
        floor_ptr="*fp32", live_ptr="*i32", need_ptr="*i32", V=d16, NBLK="i32", C=d16,
        CHUNK=d16, stride_zb=d16, stride_db="i32", z_off=d16, step="i32", done_off="i32",
        RPR="i32", ROWS="i32"),
        dict(NBLK_P2=next_pow2(triton.cdiv(V, BLOCK_V)), TILE=hist_tile(TILE, HIST_BINS),
             NB=HIST_BINS, MODE=mode, C_P2=next_pow2(C), BLOCK_V=BLOCK_V,
             NT_P2=live_slots(CHUNK, TILE), FLOOR=mode == 2, GATE=gate, SCALED=scaled, ZIN=zin,
             ROWS_P2=row_list_p2(rows, persist and gate), PERSIST=persist and gate,
             PDL=pdl), 4)


def select_compile_config(TILE: int, CHUNK: int, C: int, BLOCK_V: int, V: int, pdl: int = 0,
                          gate: bool = False, scaled: bool = False, rows: int = 1,
                          persist: bool = False):
    """row_select_kernel's compile entry (kernels/sm12x.py readiness) for a launch at row tile
    TILE, C chunk programs of CHUNK tokens, logits blocks of BLOCK_V, vocabulary V; `gate`,
    `scaled`, `rows`, `persist` as in reduce_compile_config."""
    d16 = "i32:16"
    return compile_config(row_select_kernel, dict(
        temp_ptr="*fp32", topk_ptr="*i64", topp_ptr="*fp32", z_ptr="*fp32", rowf_ptr="*fp32",
        rowi_ptr="*i32", above_m_ptr="*i64", above_c_ptr="*i64", rowa_ptr="*i64",
        ckey_ptr="*i32", cmass_ptr="*i64", ccount_ptr="*i32", done_ptr="*i32", kext_ptr="*i32",
        rst_ptr="*i32", spill_ptr="*fp32", spn_ptr="*i32", bmax_ptr="*fp32", live_ptr="*i32",
        floor_ptr="*fp32", need_ptr="*i32", V=d16, C=d16, CHUNK=d16, NBLK="i32",
        stride_zb=d16, z_off=d16, ccount_off="i32", done_off="i32", RPR="i32", ROWS="i32"),
        dict(TILE=select_tile(TILE), NB=HIST_BINS, CAP=CAND_CAP,
             SCALE=float(2 ** mass_scale_bits(V)), C_P2=next_pow2(C), BLOCK_V=BLOCK_V,
             NT_P2=live_slots(CHUNK, TILE), SKIP=True, FEW=FEW_CANDIDATES, SCAN=True,
             GATE=gate, SCALED=scaled, ROWS_P2=row_list_p2(rows, persist and gate),
             PERSIST=persist and gate, PDL=pdl),
        SELECT_WARPS)


def refine_compile_config(TILE: int, C: int, V: int, pdl: int = 0, scaled: bool = False,
                          gate: bool = False, rows: int = 1, persist: bool = False):
    """row_refine_kernel's compile entry for a launch at row tile TILE, C chunk programs,
    vocabulary V (no logits-block dependence: it reads only the spill regions); `gate`, `rows`,
    `persist` as in reduce_compile_config."""
    d16 = "i32:16"
    return compile_config(row_refine_kernel, dict(
        temp_ptr="*fp32", topk_ptr="*i64", topp_ptr="*fp32", z_ptr="*fp32", rowf_ptr="*fp32",
        rowi_ptr="*i32", rst_ptr="*i32", above_m_ptr="*i64", above_c_ptr="*i64",
        rowa_ptr="*i64", hist_ptr="*i32", kext_ptr="*i32", spill_ptr="*fp32", spn_ptr="*i32",
        ckey_ptr="*i32", cmass_ptr="*i64", ccount_ptr="*i32", done_ptr="*i32",
        need_ptr="*i32", V=d16, C=d16, CHUNK=d16, stride_zb=d16, z_off=d16, ccount_off="i32",
        done_off="i32", RPR="i32", ROWS="i32", LAST="i32"),
        dict(TILE=refine_tile(TILE, REFINE_EDGES), NB=REFINE_EDGES, CAP=CAND_CAP,
             SCALE=float(2 ** mass_scale_bits(V)), C_P2=next_pow2(C), FEW=FEW_CANDIDATES,
             SCAN=True, GATE=gate, SCALED=scaled, ROWS_P2=row_list_p2(rows, persist and gate),
             PERSIST=persist and gate, PDL=pdl),
        SELECT_WARPS)


def launch_select_refine(flags, z, z_off: int, stride_zb: int, rowf, rowi, rst, scratch,
                         counters, select_offs, refine_offs, *, V: int, C: int, CHUNK: int,
                         RPR: int, TILE: int, NB: int, edges: int, cap: int, scan: bool,
                         bmax, BLOCK_V: int, skip: bool = True,
                         few: int = FEW_CANDIDATES, pdl: int = 0, need=None,
                         scaled: bool = False, persist: bool = False) -> None:
    """row_select_kernel, then one row_refine_kernel per entry of refine_offs (rows already
    resolved exit at once). select_offs / refine_offs: (candidate counter, ticket counter)
    offsets into `counters` for each launch (zeroed by the caller). bmax [rows, NBLK]: the
    block maxima of z over blocks of BLOCK_V tokens, from which select skips the tiles below
    the bracket (`skip`, a tuning knob). `few` (0 or a power of two): up to this many gathered
    candidates are resolved pairwise, more by bisection (tuning knob and test hook). `pdl`: the
    kernels' PDL mode (tl_helpers.PDL_MODES; > 0: programmatic dependent launch, the caller
    checked pdl_available). `need` (int32 [rows] or None): select searches only the rows flagged
    nonzero; the refine passes take the same rows (a row select skips keeps state 0).
    `persist` (with `need`): the passes run as grids of about one wave whose programs take the
    flagged rows' (row, chunk) items in turn (gated_grid, row_list), not one program per item.
    `scaled`: z holds unscaled logits, each row's divided by its temperature (scale_z)."""
    if few != 0:    # the pairwise path builds a [few, few] int64 matrix per resolving program
        check_pow2("few", few, 1, 64)
    few = min(few, cap)
    s = scratch
    scale = float(2 ** mass_scale_bits(V))
    C_P2 = next_pow2(C)
    rows, gate = rowf.shape[0], need is not None
    persist = persist and gate
    flagged = rowi if need is None else need
    launch(row_select_kernel)[gated_grid(rows, C, gated_per_sm("select", z.device), z.device,
                                         persist)](
        *flags, z, rowf, rowi, s["above_m"], s["above_c"], s["rowa"], s["ckey"], s["cmass"],
        counters, counters, s["kext"], rst, s["spill"], s["spn"], bmax, s["live"], s["floor"],
        flagged, V, C, CHUNK, bmax.shape[1], stride_zb, z_off, select_offs[0], select_offs[1],
        RPR, rows, TILE=select_tile(TILE), NB=NB, CAP=cap, SCALE=scale, C_P2=C_P2,
        BLOCK_V=BLOCK_V, NT_P2=s["live"].shape[2], SKIP=skip, FEW=few, SCAN=scan, GATE=gate,
        SCALED=scaled, ROWS_P2=row_list_p2(rows, persist), PERSIST=persist, PDL=pdl,
        num_warps=SELECT_WARPS, **pdl_launch(pdl))
    for r, (co, do) in enumerate(refine_offs):
        launch(row_refine_kernel)[gated_grid(rows, C, gated_per_sm("refine", z.device),
                                             z.device, persist)](
            *flags, z, rowf, rowi, rst, s["above_m"], s["above_c"], s["rowa"], s["hist"],
            s["kext"], s["spill"], s["spn"], s["ckey"], s["cmass"], counters, counters, flagged,
            V, C, CHUNK, stride_zb, z_off, co, do, RPR, rows, int(r == len(refine_offs) - 1),
            TILE=refine_tile(TILE, edges), NB=edges, CAP=cap, SCALE=scale, C_P2=C_P2, FEW=few,
            SCAN=scan, GATE=gate, SCALED=scaled, ROWS_P2=row_list_p2(rows, persist),
            PERSIST=persist, PDL=pdl, num_warps=SELECT_WARPS, **pdl_launch(pdl))
