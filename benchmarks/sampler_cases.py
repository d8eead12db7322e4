"""Sampler benchmark cases (group "sampler"), Flash dims: V = 129280, r = 256, N = 5.

    python benchmarks/kernel_bench.py --only sampler --out benchmarks/results/h200_sampler
    python benchmarks/kernel_bench.py --only sampler --ops markov_greedy --batches 1,64

Cases per B (requests):
- `markov_greedy`: every row greedy. Variants: the reference (eager / torch.compile), `ours`
  (the op in its default "full" mode, which still launches the probabilistic passes),
  `ours-mode-greedy` (the op with mode="greedy": the graph an all-greedy batch can capture),
  `ours-g*` its step-kernel tilings (tuning data for GREEDY_CONFIGS), `ours-nopdl` its steps
  without programmatic dependent launch;
  `ours-mode-greedy-forward` / `ours-forward` (markov_topp): every step walks W2 in the same
  order (reverse_odd_steps=False), the L2 reuse across steps off.
- `markov_topp_peaked` / `rejection_topp_peaked`: the same on the logits of a confident head
  (`peaked_logits`: 32 tokens per row 11-16 nats above a Gaussian bulk; top-p 0.95 keeps 5-25
  tokens on most rows, hundreds to ~1400 on the least lifted ones). The plain cases' Gaussian
  rows (std 3) are the stress case: top-p 0.95 keeps ~10^4 tokens there. `ours-noskip` (top-p
  cases): the select pass reads every tile (skip_below_bracket=False).
- `markov_topp`: T = 1.0, top-p 0.95 (the deployed setting). `ours-nocand` (top-p cases): without the candidate pick,
  every row's threshold is searched each step (candidate=False, the plan before 5b45da0);
  `ours-nopersist`: the searched rows' launches one program per row and chunk instead of
  persistent grids (persistent=False). `ours-refine4` / `ours-refine2`: 4 / 2 threshold
  refinement passes instead of REFINE_PASSES (3); `ours-hist8` / `ours-hist32`: threshold mass
  histograms of 8 / 32 bins instead of HIST_BINS (16); `ours-cap1024` / `ours-cap4096`: 1024 / 4096
  threshold candidates instead of CAND_CAP (2048); `ours-edges32` / `ours-edges64`: refinement
  passes splitting at 32 / 64 edges instead of REFINE_EDGES (16), `ours-hist8-edges64` both
  knobs; `ours-chunk<n>`: n tokens per row-pass program instead of row_tiling's.
- `rejection_topp`: target rows [B, 6, V] fp32, draft logits = target + noise (std 1), drafts
  drawn from their q = softmax(process(draft logits)), T = 1.0, top-p 0.95. `rejection_greedy`: T = 0, drafts = target argmax for the first two rows;
  `ours-mode-greedy` is the op's all-greedy plan (mode="greedy", the engine's greedy variant).
  `ours-nobounds` (top-p cases): without the bound walk, every target and draft row is
  searched; `ours-serial`: the draft rows' statistics pass and search after the target
  rows', on one stream (overlap=False; the default runs them beside the target rows' on a
  side stream); `ours-persist`: the searches in persistent grids of about one wave
  (rejection_persistent=True; the default launches one program per row and chunk);
  `ours-nopdl` / `ours-pdl-early` / `ours-pdl-late`: the launches after the statistics pass
  without programmatic dependent launch / with each trigger point; `ours-chunk<n>`: n tokens
  per row-pass program instead of row_tiling's (the searches run on the few rows the walk
  flags).
- `rejection_block_topp` / `rejection_block_topp_peaked`: the top-p cases with every request
  block-verified (verify = VERIFY_BLOCK: every target and draft row searched, the residual
  masses S_1 .. S_4 read the middle rows once more); compare with `rejection_topp(_peaked)`,
  the same data token-wise. `ours-serial` / `ours-persist` / `ours-chunk<n>` as there.
- `sample_topp`: plain target sampling of [B, V] fp32 logits, T = 1.0, top-p 0.95.

bytes_moved (fewest bytes one call must move): Markov = 5 reads of W2 (66.2 MB bf16) + the base
logits (fp32, as the draft head produces them) + the W1 rows + for probabilistic rows the
draft_logits written once (fp32). The greedy byte floor (~78 us at B = 1) is the W2 part.
Rejection = per request the target rows up to the first rejection and its draft row (data
dependent: counted as 2 target rows + 1 draft row, about what the drafts here produce), plus
tokens; block verification reads every row's distribution: all N + 1 target and N draft rows.
"""
from __future__ import annotations

import torch
from harness import Case, compare

from dspark_compile.kernels.sampling import markov as ms
from dspark_compile.kernels.sampling import reference as sampling
from dspark_compile.kernels.sampling import rejection as rj
from dspark_compile.kernels.sampling.plan import PLAN


def _markov(d, **plan):
    """The Markov launcher on case data d under PLAN with `plan`'s fields changed."""
    return ms.markov_sample_launch(**d, plan=PLAN.replace(**plan))


def _rejection(d, **plan):
    """The rejection launcher on case data d under PLAN with `plan`'s fields changed."""
    return rj.rejection_sample_launch(**d, plan=PLAN.replace(**plan))

V, R, N = 129280, 256, 5
TOP_P = 0.95
W_STD = (0.5 / R ** 0.5) ** 0.5       # bias std ~0.5, as dspark_compile/factory/synth.py draws the Markov head

_WEIGHTS: dict = {}

def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def _weights(device):
    """W1/W2 shared by every input set (weights are shared by every step in the engine too)."""
    key = str(device)
    if key not in _WEIGHTS:
        g = _gen(device, 7)
        _WEIGHTS[key] = tuple((torch.randn(V, R, generator=g, device=device) * W_STD).bfloat16()
                              for _ in range(2))
    return _WEIGHTS[key]


def _sampling(B, T, top_p, g, device, position="start_pos"):
    """Per-row sampling parameters as every sampler op takes them (random seeds/positions)."""
    return {"temperature": torch.full((B,), T, device=device),
            "top_k": torch.zeros(B, dtype=torch.int64, device=device),
            "top_p": torch.full((B,), top_p, device=device),
            "seed": torch.randint(0, 2 ** 62, (B,), generator=g, device=device),
            position: torch.randint(0, 100000, (B,), generator=g, device=device)}


def peaked_logits(shape, g, device):
    """Logits of a confident head: a Gaussian bulk (std 2) and 32 tokens per row raised by
    11-16 nats (drawn per row). Top-p 0.95 keeps 5-25 tokens on most rows, and hundreds to
    ~1400 where the lift is small enough that the threshold falls into the bulk's upper tail
    (64 rows drawn on the CPU: 56 rows 5-25 tokens, 8 rows 53-1408)."""
    x = torch.randn(*shape, generator=g, device=device) * 2.0
    hot = torch.randint(0, shape[-1], (*shape[:-1], 32), generator=g, device=device)
    lift = 11.0 + 5.0 * torch.rand(*shape[:-1], 1, generator=g, device=device)
    return x.scatter_add_(-1, hot, lift.expand(*shape[:-1], 32).contiguous())


def _markov_inputs(B, T, top_p, peaked=False):
    def make(device, seed):
        g = _gen(device, seed)
        w1, w2 = _weights(device)
        base = peaked_logits((B, N, V), g, device) if peaked else \
            torch.randn(B, N, V, generator=g, device=device) * 3.0
        return {"base_logits": base,
                "anchor": torch.randint(0, V, (B,), generator=g, device=device),
                "w1": w1, "w2": w2, **_sampling(B, T, top_p, g, device)}
    return make


def _rows_differ(same: torch.Tensor) -> str:
    """The check column: "" when every row equals the reference, else how many differ."""
    return "" if bool(same.all()) else f"{int((~same).sum())}/{same.numel()} rows differ"


def _markov_check(make, greedy):
    def check(device):
        d = make(device, 123)
        got_d, got_p = torch.ops.dspark.markov_sample(**d)
        want_d, want_p = sampling.markov_sample_reference(**d)
        same = (got_d == want_d).all(1)
        msgs = [_rows_differ(same)]      # bias sums differ in order: a near-tie may flip a row
        if not greedy and same.any():
            msgs.append(compare("draft_logits", got_p[same], want_p[same]))
        return "; ".join(m for m in msgs if m)
    return check


def _markov_bytes(B, probabilistic):
    """The floor of a call: the draft logits' write counts for probabilistic cases only (the
    greedy case's floor is the greedy plan's, which writes none)."""
    w2 = V * R * 2
    out = B * N * V * 4 if probabilistic else 0
    return N * w2 + B * N * V * 4 + B * N * R * 2 + B * N * 8 + out


# greedy step-kernel tilings (BLOCK_V, num_warps, STAGES, PROGS_PER_SM) per batch tile (see
# plan.GREEDY_CONFIGS; PROGS_PER_SM 0 = one program per vocab block). Tuning data only.
GREEDY_TILINGS = {
    16: [(32, 4, 3, 4), (32, 4, 3, 2), (64, 4, 1, 0), (64, 4, 2, 4)],
    32: [(32, 4, 3, 3), (32, 4, 3, 2)],
    64: [(16, 4, 4, 2), (32, 4, 3, 1), (32, 4, 2, 3), (32, 4, 1, 0)],
}


def _greedy_variants(B):
    """Mode "greedy" knobs: `ours-nopdl` without programmatic dependent launch between the
    steps; `ours-g*` step-kernel tilings (BLOCK_V, warps, STAGES, PROGS_PER_SM)."""
    out = {"ours-nopdl": lambda d: _markov(d, mode="greedy", pdl=False)}
    out.update({f"ours-g{'x'.join(map(str, c))}":
                (lambda d, c=c: _markov(d, mode="greedy", greedy_config=c))
                for c in GREEDY_TILINGS[ms._batch_tile(B)]})
    return out


def _skip_variants():
    """`ours-noskip`: select reads every tile (skip_below_bracket=False); `ours-nofloor`: the
    threshold search reads the whole row, not only the tokens above the block maxima's floor
    (block_floor=False); `ours-nopdl`: plain launches (pdl=False), `ours-pdl-early` /
    `ours-pdl-late`: the next launch may start when every program has started / has finished its
    main loop (pdl="early" / "late"); `ours-few0` / `ours-few64`: thresholds always by bisection
    / pairwise up to 64 candidates (few_candidates; FEW_CANDIDATES is 32); `ours-nopersist`:
    the searched rows' launches one program per row and chunk (persistent=False); `ours-nocand`:
    every row searched and sampled by final (candidate=False)."""
    return {"ours-nocand": lambda d: _markov(d, candidate=False),
            "ours-nopersist": lambda d: _markov(d, persistent=False),
            "ours-noskip": lambda d: _markov(d, skip_below_bracket=False),
            "ours-nofloor": lambda d: _markov(d, block_floor=False),
            "ours-nopdl": lambda d: _markov(d, pdl=False),
            "ours-pdl-early": lambda d: _markov(d, pdl="early"),
            "ours-pdl-late": lambda d: _markov(d, pdl="late"),
            "ours-few0": lambda d: _markov(d, few_candidates=0),
            "ours-few64": lambda d: _markov(d, few_candidates=64)}


def _threshold_variants():
    """Threshold search knobs (kernels/sampling/): refinement launches per step (each one more
    launch, near-empty for rows already resolved), mass-histogram bins (cost per token grows
    with them, brackets narrow faster) and the candidate cap (the resolving program bisects over
    that many registers; a smaller cap overflows into one more refinement pass more often)."""
    out = {"ours-forward": lambda d: _markov(d, reverse_odd_steps=False),
           **_skip_variants(),
           "ours-refine4": lambda d: _markov(d, refine_passes=4),
           "ours-refine2": lambda d: _markov(d, refine_passes=2)}
    out.update({f"ours-hist{n}": (lambda d, n=n: _markov(d, hist_bins=n))
                for n in (8, 32)})
    out.update({f"ours-cap{n}": (lambda d, n=n: _markov(d, cap=n))
                for n in (1024, 4096)})
    out.update({f"ours-edges{n}": (lambda d, n=n: _markov(d, refine_edges=n))
                for n in (32, 64)})
    out["ours-hist8-edges64"] = lambda d: _markov(d, hist_bins=8,
                                                                  refine_edges=64)
    out.update(_chunk_variants())
    return out


def _chunk_variants():
    """`ours-chunk<n>`: n tokens per row-pass program (row_tiling's default: 2048 / 4096 / 8192
    for <= 4 / <= 16 / more rows): more, shorter programs per row against more partials to
    combine."""
    return {f"ours-chunk{n}": (lambda d, n=n: _markov(d, chunk=n))
            for n in (512, 1024, 4096, 16384)}


def markov_cases(batches):
    out = []
    for B in batches:
        make = _markov_inputs(B, 0.0, 1.0)
        extra = {"ours-mode-greedy": lambda d: torch.ops.dspark.markov_sample(**d, mode="greedy"),
                 # every step walks W2 in the same order (no L2 reuse across steps)
                 "ours-mode-greedy-forward": lambda d: _markov(
                     d, mode="greedy", reverse_odd_steps=False)}
        extra.update(_greedy_variants(B))                    # the greedy graph's knobs
        out.append(Case("sampler", "markov_greedy", {"B": B, "N": N}, make,
                        lambda d: sampling.markov_sample_reference(**d),
                        lambda d: torch.ops.dspark.markov_sample(**d),
                        _markov_bytes(B, False), check=_markov_check(make, True), extra=extra))
        make = _markov_inputs(B, 1.0, TOP_P)
        out.append(Case("sampler", "markov_topp", {"B": B, "N": N}, make,
                        lambda d: sampling.markov_sample_reference(**d),
                        lambda d: torch.ops.dspark.markov_sample(**d),
                        _markov_bytes(B, True), check=_markov_check(make, False),
                        extra=_threshold_variants()))
        make = _markov_inputs(B, 1.0, TOP_P, peaked=True)
        out.append(Case("sampler", "markov_topp_peaked", {"B": B, "N": N}, make,
                        lambda d: sampling.markov_sample_reference(**d),
                        lambda d: torch.ops.dspark.markov_sample(**d),
                        _markov_bytes(B, True), check=_markov_check(make, False),
                        extra={**_skip_variants(), **_chunk_variants()}))
    return out


def _rejection_inputs(B, T, top_p, greedy, peaked=False, block=False):
    def make(device, seed):
        g = _gen(device, seed)
        target = peaked_logits((B, N + 1, V), g, device) if peaked else \
            torch.randn(B, N + 1, V, generator=g, device=device) * 3.0
        dl = target[:, :N] + torch.randn(B, N, V, generator=g, device=device)
        meta = _sampling(B, T, top_p, g, device)
        if greedy:
            drafts = target[:, :N].argmax(-1)
            drafts[:, 2:] = torch.randint(0, V, (B, N - 2), generator=g, device=device)
        else:       # from the draft distributions, as the Markov sampler draws them
            q = sampling.request_probs(dl, meta["temperature"], meta["top_k"], meta["top_p"])
            drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, N)
        d = {"target_logits": target, "draft_tokens": drafts, "draft_logits": dl, **meta}
        if block:
            d["verify"] = torch.full((B,), sampling.VERIFY_BLOCK, dtype=torch.int64,
                                     device=device)
        return d
    return make


def _rejection_check(make):
    def check(device):
        d = make(device, 321)
        got = torch.ops.dspark.rejection_sample(**d)
        want = sampling.rejection_sample_reference(**d)
        same = (got[0] == want[0]).all(1) & (got[1] == want[1])
        return _rows_differ(same)
    return check


def rejection_cases(batches):
    out = []
    for B in batches:
        nbytes = B * (2 * V * 4 + V * 4) + B * (N + 1) * 8 * 2
        for name, T, top_p, greedy, peaked in (
                ("rejection_topp", 1.0, TOP_P, False, False),
                ("rejection_topp_peaked", 1.0, TOP_P, False, True),
                ("rejection_greedy", 0.0, 1.0, True, False)):
            make = _rejection_inputs(B, T, top_p, greedy, peaked)
            extra = {"ours-mode-greedy": lambda d: torch.ops.dspark.rejection_sample(
                **d, mode="greedy")} if greedy else {
                "ours-noskip": lambda d: _rejection(d, skip_below_bracket=False),
                "ours-nobounds": lambda d: _rejection(d, bounds=False),
                "ours-serial": lambda d: _rejection(d, overlap=False),
                "ours-persist": lambda d: _rejection(d, rejection_persistent=True),
                **{f"ours-chunk{n}": (lambda n: lambda d: _rejection(
                    d, chunk=n))(n) for n in (2048, 4096)},
                **{f"ours-{n}": (lambda m: lambda d: _rejection(d, pdl=m))(m)
                   for n, m in (("nopdl", False), ("pdl-early", "early"),
                                ("pdl-late", "late"))}}
            out.append(Case("sampler", name, {"B": B, "N": N}, make,
                            lambda d: sampling.rejection_sample_reference(**d),
                            lambda d: torch.ops.dspark.rejection_sample(**d),
                            nbytes, check=_rejection_check(make), extra=extra))
        out += _block_cases(B)
    return out


def _block_cases(B):
    """Block verification on the top-p cases' data (every request block-verified)."""
    nbytes = B * (2 * N + 1) * V * 4 + B * (N + 1) * 8 * 2
    out = []
    for name, peaked in (("rejection_block_topp", False), ("rejection_block_topp_peaked", True)):
        make = _rejection_inputs(B, 1.0, TOP_P, False, peaked, block=True)
        extra = {"ours-serial": lambda d: _rejection(d, overlap=False),
                 "ours-persist": lambda d: _rejection(d, rejection_persistent=True),
                 **{f"ours-chunk{n}": (lambda n: lambda d: _rejection(d, chunk=n))(n)
                    for n in (2048, 4096)}}
        out.append(Case("sampler", name, {"B": B, "N": N}, make,
                        lambda d: sampling.rejection_sample_reference(**d),
                        lambda d: torch.ops.dspark.rejection_sample(**d),
                        nbytes, check=_rejection_check(make), extra=extra))
    return out


def _sample_inputs(B):
    def make(device, seed):
        g = _gen(device, seed)
        return {"logits": torch.randn(B, V, generator=g, device=device) * 3.0,
                **_sampling(B, 1.0, TOP_P, g, device, position="position")}
    return make


def _sample_check(make):
    def check(device):
        d = make(device, 99)
        same = torch.ops.dspark.sample(**d) == sampling.sample_reference(**d)
        return _rows_differ(same)
    return check


def sample_cases(batches):
    out = []
    for B in batches:
        make = _sample_inputs(B)
        out.append(Case("sampler", "sample_topp", {"B": B}, make,
                        lambda d: sampling.sample_reference(**d),
                        lambda d: torch.ops.dspark.sample(**d),
                        B * V * 4 + B * 8 * 4, check=_sample_check(make)))
    return out


def cases(batches):
    return markov_cases(batches) + rejection_cases(batches) + sample_cases(batches)
