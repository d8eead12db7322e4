"""The samplers' specification in PyTorch: logits processing, probabilities, Gumbel keys, id
folding, and the reference of each op (`markov_sample`, `rejection_sample`, `sample`).

- A row is greedy iff temperature[b] < GREEDY_BELOW (1e-5, compared in fp32; 0 and negative
  included): argmax of the raw logits (ties -> lowest id).
- Otherwise z = logits / T (fp32), then top-k keeps every token with z >= the k-th largest
  (top_k <= 0 or >= V: off; ties kept, so the kept set is a threshold z >= tau), top-p keeps the
  smallest set of largest tokens whose mass reaches top_p of the top-k distribution (top_p >= 1
  or NaN: off; the top token always kept; ties at tau kept); p = softmax over the kept tokens.
- A degenerate row (a NaN, or a maximum not finite) yields token 0 and all-zero probabilities.
- Sampling from p is Gumbel-max: argmax_v(log p(v) + g(v)), g = philox.vocab_gumbel(seed,
  position of the token sampled, V, stream); excluded tokens never win; nothing left -> 0.
- Token ids outside [0, V) are folded to 0 (fold_ids) before they index anything.

Top-p's cumulative masses are summed in float64 here (the exact definition); the fused kernels
sum fixed-point masses (order independent). They agree except where a token's mass-above lies
within ~1e-7 of top_p * Z.
"""
from __future__ import annotations

import torch

from dspark_compile.kernels.common import row_matmul
from dspark_compile.kernels.philox import (STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESAMPLE,
                                           STREAM_TARGET, uniform, vocab_gumbel)
from dspark_compile.kernels.region import fusable

NEG_INF = float("-inf")

# Temperatures below this are greedy, in every sampler (this reference, the Triton kernels
# through kernels/sampling/device.py, the engine's choice of its greedy program) and at
# admission (models/request.py SamplingParams.validate stores them as 0). Why 1e-5 (vLLM's
# _SAMPLING_EPS is the same): z = logits / T in fp32 overflows to inf once |logit| > T * 3.4e38,
# and an inf makes the row degenerate (token 0, all-zero probabilities): at T = 1e-38 already
# for |logit| > 3.4, at the subnormal T = 1e-45 for every |logit| > 5e-7 -- the garbage of
# issue 50. At T >= 1e-5 only |logit| > 3.4e33 overflows. Nothing is lost below it: a token
# gap logits below the best has relative weight exp(-gap / T), which fp32 rounds away next to
# 1 (< 2^-24) for gap > 16.7 T and flushes to 0 for gap > 104 T: at T < 1e-5 the distribution
# is the argmax's one-hot save for logits within 1.7e-4 of the best, and bf16 logits of
# magnitude >= 1 are 2^-7 apart or equal (where greedy takes the lowest id).
GREEDY_BELOW = 1e-5


def fold_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids outside [0, vocab) -> 0 (same dtype and shape)."""
    return torch.where((ids >= 0) & (ids < vocab), ids, torch.zeros_like(ids))


def greedy_rows(temperature: torch.Tensor) -> torch.Tensor:
    """[B] bool: temperature < GREEDY_BELOW, compared in fp32 as the kernels do (a NaN
    temperature is not greedy; its row is degenerate)."""
    return temperature.float() < GREEDY_BELOW


def is_greedy(temperature: float) -> bool:
    """The same rule for one host temperature (a Python number; NaN is not greedy). Compared
    in float64: a value in [1e-5 rounded down to fp32, 1e-5) is greedy here and not in fp32,
    but SamplingParams.validate stores every temperature this calls greedy as 0, so a state
    row is greedy for the kernels exactly when its request is greedy here (fp32 rounding is
    monotone: T >= 1e-5 stores as >= fp32(1e-5))."""
    return temperature < GREEDY_BELOW


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


def check_markov_inputs(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos):
    if base_logits.dim() != 3 or not base_logits.dtype.is_floating_point:
        raise ValueError(f"base_logits must be a float [B, N, V] tensor, got {base_logits.dtype} "
                         f"{tuple(base_logits.shape)}")
    B, N, V = base_logits.shape
    if V == 0:
        raise ValueError(f"base_logits must have a vocabulary (V >= 1), got "
                         f"{tuple(base_logits.shape)}")
    if w1.dim() != 2 or w1.shape[0] != V or not w1.dtype.is_floating_point:
        raise ValueError(f"w1 must be a float [{V}, r] tensor, got {w1.dtype} {tuple(w1.shape)}")
    if w2.shape != w1.shape or not w2.dtype.is_floating_point:
        raise ValueError(f"w2 must be a float {tuple(w1.shape)} tensor like w1, got {w2.dtype} "
                         f"{tuple(w2.shape)}")
    if anchor.shape != (B,) or anchor.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"anchor must be an int [{B}] tensor, got {anchor.dtype} "
                         f"{tuple(anchor.shape)}")
    check_sampling_params(B, temperature, top_k, top_p, seed, start_pos, "start_pos")


def markov_bias(prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """W1[prev] @ W2^T in fp32: [B, V] (prev already folded into [0, V))."""
    return row_matmul(w1[prev].float(), w2.float().T)


@fusable("markov_sample")
def markov_sample_reference(base_logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor,
                            w2: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor, seed: torch.Tensor, start_pos: torch.Tensor):
    """The DSpark Markov draft sampler -> (drafts [B, N] int64, draft_logits [B, N, V] fp32).

        prev = fold_ids(anchor)
        for k in 0..N-1:                   # draft k is the token at position start_pos + k
            l_k = base_logits[:, k] + W1[prev] @ W2^T        (fp32; draft_logits[:, k], every row)
            greedy rows: x_k = argmax(l_k)
            other rows:  x_k = argmax(process(l_k) + Gumbel(seed, start_pos + k, STREAM_DRAFT))
            prev = x_k

    The draft distribution of step k is q_k = softmax(process(draft_logits[:, k])); rejection
    sampling computes it where it reads it (request_probs in its reference)."""
    check_markov_inputs(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos)
    B, N, V = base_logits.shape
    greedy = greedy_rows(temperature)
    prev = fold_ids(anchor.to(torch.int64), V)
    drafts, out = [], []
    for k in range(N):
        logits = base_logits[:, k].float() + markov_bias(prev, w1, w2)
        # Gumbel-max over the kept tokens' z itself (log q up to a constant): the fused kernel
        # can then pick the argmax of z + g over the whole row before it knows the kept set
        z = process_logits(logits, temperature, top_k, top_p)
        x = gumbel_argmax(z, seed, start_pos + k, STREAM_DRAFT)
        x = torch.where(greedy, argmax_tokens(logits), x)
        out.append(logits)
        drafts.append(x)
        prev = x
    return torch.stack(drafts, 1), torch.stack(out, 1)


def check_rejection_inputs(target_logits, draft_tokens, draft_logits, temperature, top_k, top_p,
                           seed, start_pos, verify=None):
    if target_logits.dim() != 3 or not target_logits.dtype.is_floating_point:
        raise ValueError(f"target_logits must be a float [B, N+1, V] tensor, got "
                         f"{target_logits.dtype} {tuple(target_logits.shape)}")
    B, N1, V = target_logits.shape
    N = N1 - 1
    if N < 0:
        raise ValueError("target_logits needs at least one row per request (N + 1 >= 1)")
    if draft_tokens.shape != (B, N) or draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an int [{B}, {N}] tensor, got "
                         f"{draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    if draft_logits.shape != (B, N, V) or not draft_logits.dtype.is_floating_point:
        raise ValueError(f"draft_logits must be a float [{B}, {N}, {V}] tensor, got "
                         f"{draft_logits.dtype} {tuple(draft_logits.shape)}")
    check_sampling_params(B, temperature, top_k, top_p, seed, start_pos, "start_pos")
    if verify is not None:
        _check_rows("verify", verify, B, INTS)


# The rejection op's per-request `verify` values (models/request.py SamplingParams.verify):
# token-wise rejection (Leviathan / Chen) or block verification (Sun et al., arXiv 2403.10444).
# Greedy rows ignore it; any nonzero value is block.
VERIFY_TOKEN = 0
VERIFY_BLOCK = 1
VERIFY = {"token": VERIFY_TOKEN, "block": VERIFY_BLOCK}


def accept_uniforms(seed: torch.Tensor, start_pos: torch.Tensor, N: int) -> torch.Tensor:
    """The acceptance tests' uniforms [B, N]: u_i = uniform(seed, 0, start_pos + i,
    STREAM_ACCEPT), draft i's (token-wise) or eta_{i+1} (block verification)."""
    pos = start_pos.to(torch.int64)[:, None] + torch.arange(N, device=seed.device)[None, :]
    zeros = torch.zeros_like(pos)
    return uniform(seed.to(torch.int64)[:, None], zeros, pos, zeros + STREAM_ACCEPT)


def draft_probs(p: torch.Tensor, draft_tokens: torch.Tensor, q: torch.Tensor):
    """(p_i(x_i), q_i(x_i), x_i valid) [B, N] of each draft x_i (ids outside [0, V) folded to
    0 for the gather, and not valid). p: target probabilities [B, >= N, V]; q: draft
    probabilities [B, N, V]."""
    N = draft_tokens.shape[1]
    V = p.shape[-1]
    d = draft_tokens.to(torch.int64)
    x = fold_ids(d, V)[..., None]
    return (p[:, :N].gather(2, x).squeeze(2), q.gather(2, x).squeeze(2), (d >= 0) & (d < V))


def sampled_accepts(p: torch.Tensor, draft_tokens: torch.Tensor, q: torch.Tensor,
                    seed: torch.Tensor, start_pos: torch.Tensor) -> torch.Tensor:
    """Each draft's acceptance test for a sampling request, as if every earlier draft had been
    accepted: bool [B, N], x valid, q(x) > 0 and p(x) >= u q(x). p: target probabilities
    [B, >= N, V]; q: draft probabilities [B, N, V]."""
    px, qx, valid = draft_probs(p, draft_tokens, q)
    u = accept_uniforms(seed, start_pos, draft_tokens.shape[1])
    return valid & (qx > 0) & (px >= u * qx)


def block_weights(p: torch.Tensor, draft_tokens: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Block verification's weights w [B, N + 1] fp32: w_0 = 1, w_i = min(w_{i-1} r_i, 1) with
    r_i = p_{i-1}(x_{i-1}) / q_{i-1}(x_{i-1}) of draft i - 1 (0-based rows: target row i - 1
    predicts draft i - 1), r = 0 for a draft out of range or with q(x) = 0. A quotient that
    overflows is +inf (w -> 1); w = 0 stays 0 (0 * inf would be NaN)."""
    px, qx, valid = draft_probs(p, draft_tokens, q)
    ok = valid & (qx > 0)
    r = torch.where(ok, px / torch.where(ok, qx, torch.ones_like(qx)), torch.zeros_like(px))
    w = [torch.ones_like(r[:, 0]) if r.shape[1] else r.new_ones(r.shape[0])]
    for i in range(r.shape[1]):
        w.append(torch.where(w[-1] > 0, torch.clamp_max(w[-1] * r[:, i], 1.0),
                             torch.zeros_like(w[-1])))
    return torch.stack(w, 1)


def block_thresholds(p: torch.Tensor, draft_tokens: torch.Tensor, q: torch.Tensor):
    """Block verification's acceptance thresholds h [B, N] (h[:, i - 1] = h_i) and weights
    w [B, N + 1] (block_weights) from target probabilities p [B, N + 1, V] and draft
    probabilities q [B, N, V]:

        S_i = sum_x max(w_i p_i(x) - q_i(x), 0)           i = 1 .. N-1 (0-based rows i)
        h_i = S_i / (S_i + 1 - w_i)  (1 if that is 0 / 0: w_i = 1 and S_i = 0),  h_N = w_N

    In p's dtype (S summed by torch: the fused kernel's order differs, so decisions agree
    except within rounding of eta_i = h_i)."""
    N = draft_tokens.shape[1]
    w = block_weights(p, draft_tokens, q)
    wi = w[:, 1:N]
    S = (wi[..., None] * p[:, 1:N] - q[:, 1:N]).clamp_min(0.0).sum(-1)
    den = (S + 1.0) - wi
    pos = den > 0
    h = torch.where(pos, S / torch.where(pos, den, torch.ones_like(den)), torch.ones_like(den))
    return torch.cat((h, w[:, N:]), 1), w


def block_accepts(p: torch.Tensor, draft_tokens: torch.Tensor, q: torch.Tensor,
                  seed: torch.Tensor, start_pos: torch.Tensor):
    """Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding",
    arXiv 2403.10444, Algorithm 2) of the N drafts of each request -> (tau [B] int64, the
    accepted count in [0, N]; w_tau [B], the weight of its residual):

        tau = the largest i with eta_i < h_i (0 if none); eta_i = accept_uniforms[:, i - 1]

    (block_thresholds' h). The token after the accepted prefix is drawn from
    max(w_tau p_tau - q_tau, 0) (p_N for tau = N), as rejection_sample_reference does. With
    "<" an h of 0 never accepts, even for eta = 0: a draft the target excludes has w = 0 from
    there on, so every later h is 0 too."""
    B, N = draft_tokens.shape
    if N == 0:
        return (torch.zeros(B, dtype=torch.int64, device=p.device),
                torch.ones(B, dtype=p.dtype, device=p.device))
    h, w = block_thresholds(p, draft_tokens, q)
    u = accept_uniforms(seed, start_pos, N)
    i = torch.arange(1, N + 1, device=p.device)[None, :].expand(B, N)
    tau = torch.where(u < h, i, torch.zeros_like(i)).amax(1)
    return tau, w.gather(1, tau[:, None]).squeeze(1)


@fusable("rejection_sample")
def rejection_sample_reference(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                               draft_logits: torch.Tensor, temperature: torch.Tensor,
                               top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                               start_pos: torch.Tensor, verify: torch.Tensor | None = None):
    """Rejection sampling of the drafts against the target -> (tokens [B, N+1] int64, the
    accepted drafts then the resampled / bonus token, -1 after them; num_sampled [B] in
    [1, N + 1]). Target row i predicts position start_pos + i (draft i's; i = N: the bonus).

    - Greedy rows: accept draft i while it equals argmax(target row i); at the first mismatch
      emit that argmax; all N accepted: the bonus argmax of row N.
    - Other rows (Leviathan / Chen): p_i = softmax(process(target row i)), q_i =
      softmax(process(draft_logits[:, i])), u_i = uniform(seed, 0, start_pos + i,
      STREAM_ACCEPT); accept x iff q_i(x) > 0 and p_i(x) >= u_i q_i(x). At the first rejection
      sample the residual max(p_i - q_i, 0) (p_i if that is all zero) by Gumbel-max keyed
      (seed, start_pos + i, STREAM_RESAMPLE); all N accepted: the bonus from p_N alike.
    - Sampled rows with verify[b] != 0 (VERIFY_BLOCK; None: every row token-wise): block
      verification (block_accepts) with the same p, q and uniforms decides the accepted count
      a = tau jointly, and the token after it is drawn from max(w_a p_a - q_a, 0) (p_a if that
      is all zero; p_N for a = N) with the same Gumbel noise. Greedy rows ignore verify.
    - Draft ids outside [0, V) are always rejected and never used as an index.
    """
    check_rejection_inputs(target_logits, draft_tokens, draft_logits, temperature, top_k, top_p,
                           seed, start_pos, verify)
    B, N1, V = target_logits.shape
    N = N1 - 1
    dev = target_logits.device
    greedy = greedy_rows(temperature)
    z = process_requests(target_logits, temperature, top_k, top_p)
    p = probs_from_processed(z).reshape(B, N1, V)
    logp = logprobs_from_processed(z).reshape(B, N1, V)
    target_arg = argmax_tokens(target_logits.reshape(B * N1, V).float()).reshape(B, N1)

    # acceptance of each draft, as if every earlier one had been accepted
    d = draft_tokens.to(torch.int64)
    q = request_probs(draft_logits, temperature, top_k, top_p)
    ok = torch.where(greedy[:, None], (d == target_arg[:, :N]) & (d >= 0) & (d < V),
                     sampled_accepts(p, d, q, seed, start_pos))
    a = torch.cumprod(ok.to(torch.int64), dim=1).sum(1)                     # a in [0, N]
    wa = None                               # the residual's weight (token-wise: 1, exactly)
    if verify is not None:
        block = ~greedy & (verify != VERIFY_TOKEN)
        tau, w_tau = block_accepts(p, d, q, seed, start_pos)
        a = torch.where(block, tau, a)
        wa = torch.where(block, w_tau, torch.ones_like(w_tau))

    # the token after the accepted prefix: resampled at row a (a < N) or the bonus (a = N)
    rows = torch.arange(B, device=dev)
    pa, logpa = p[rows, a], logp[rows, a]
    qa = torch.cat((q, q.new_zeros((B, 1, V))), 1)[rows, a]  # q_N = 0 (also when N = 0)
    resid = (pa - qa if wa is None else wa[:, None] * pa - qa).clamp_min(0.0)
    use_p = (resid.sum(-1) <= 0)[:, None] | (a == N)[:, None]
    logw = torch.where(use_p, logpa, torch.log(resid))
    last = gumbel_argmax(logw, seed, start_pos.to(torch.int64) + a, STREAM_RESAMPLE)
    last = torch.where(greedy, target_arg[rows, a], last)

    num_sampled = a + 1
    col = torch.arange(N1, device=dev)[None, :]
    drafts_ext = torch.cat((d, d.new_zeros((B, 1))), 1)
    tokens = torch.where(col < a[:, None], drafts_ext, torch.full_like(drafts_ext, -1))
    tokens = torch.where(col == a[:, None], last[:, None], tokens)
    return tokens, num_sampled
