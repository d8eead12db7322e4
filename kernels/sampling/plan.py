"""The samplers' launch choices: one frozen `SamplerPlan` with the production defaults.

Every launcher of this package (markov.markov_sample_launch, rejection.rejection_sample_launch,
sample.sample_launch) takes its data tensors and a plan; the ops use `PLAN` with the graph's
`mode`. Timings: H200, Flash dims (V = 129280, r = 256). RESULTS below is
benchmarks/results/README.md, "Sampler": the latest numbers and, under "Sampler launch choices
and the measurements behind them", each choice with the commit that measured it (git keeps that
commit's result files). A field that no benchmark compares any more is not a field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

from dspark_compile.kernels.tl_helpers import pdl_mode

RESULTS = "benchmarks/results/README.md"

# The ops' `mode` argument: "full" reads every row's temperature / top-k / top-p; "greedy"
# treats every row as greedy (the all-greedy step variant, dspark_compile/runtime/variants.py).
MODES = ("full", "greedy")

# -- threshold search (kernels/sampling/row_passes.py, refine.py) -------------------------------
# 16 bins of 2 nats: 8 bins made reduce ~2x faster but spilled twice the tokens (1.55 vs
# 1.33 ms a Markov call at B = 64, top-p 0.95), 32 bins 2.27 ms (RESULTS).
HIST_BINS = 16
# edges per refinement pass over the spilled bracket: ~16-fold narrowing a pass
# (`ours-edges*` in RESULTS).
REFINE_EDGES = 16
# refinement launches per search (always launched; resolved rows exit at once): near-flat
# rows take one histogram pass and one gathering pass (`ours-refine*`, RESULTS).
REFINE_PASSES = 3
# candidates one program resolves in registers: a 2-nat bin of a peaked row holds tens to
# ~1400 tokens (`ours-cap*`, RESULTS).
CAND_CAP = 2048
# up to this many candidates resolve pairwise, not by up to 32 dependent bisection steps; 64
# took select to 80 registers on sm_90 (3 programs per SM instead of 4) (RESULTS).
FEW_CANDIDATES = 32

# -- Markov sampler (kernels/sampling/markov.py) -----------------------------------------------
# (BLOCK_B, BLOCK_V, BLOCK_R, num_warps, STAGES) of the logits kernel per batch tile: the best
# of the H200 sweeps, no spills and <= 99 KB shared memory on sm_120 (RESULTS).
LOGITS_CONFIGS = {16: (16, 128, 64, 8, 3), 32: (32, 128, 32, 8, 3), 64: (64, 64, 64, 4, 3)}
# (BLOCK_V, num_warps, STAGES, PROGS_PER_SM) of the greedy step kernel per batch tile, 2-byte
# weights: 128 KB of W2 in flight per SM; one program per block 25-50 % slower, 8 warps 1.6x
# (RESULTS, a9d242e). The 32-row tile, not measured, takes the 16-row one's shape.
GREEDY_CONFIGS = {16: (64, 4, 3, 2), 32: (64, 4, 3, 2), 64: (32, 4, 3, 2)}
# fp32 weights: the same tile bytes; one tile in flight for 32 / 64 rows (their W1 rows take
# twice the shared memory) (sm_120 limit, tests/kernels/test_sm12x_resources.py).
GREEDY_CONFIGS_FP32 = {16: (32, 4, 3, 2), 32: (32, 4, 2, 2), 64: (16, 4, 2, 2)}
# PDL release point per batch tile: "late" 9-37 us faster at B = 4 and 27 us at B = 1,
# "early" 10-19 us faster at B = 64; B = 17..32 not measured (RESULTS, 517114f).
PDL_BY_TILE = {16: "late", 32: "late", 64: "early"}
# gated launches in persistent grids from this many rows: B = 64 -125 us a call on peaked rows,
# -31 on Gaussian ones; B = 16 -13 / +7; B = 1 and 4 +4 (RESULTS, PERSIST_FROM_ROWS).
PERSIST_FROM_ROWS = 16
# programs per SM of `final`'s persistent grid: its PERSIST build's registers (80-114) keep 4
# resident on sm_90 and sm_120 (benchmarks/kernel_resources.py).
FINAL_PER_SM = 4

# -- rejection / plain sampling (kernels/sampling/rejection.py) ---------------------------------
# PDL release point by request count: "late" 6 us faster at B = 1, "early" 1-3 us faster at
# B = 4, 16, 64; B = 2, 3 not measured (RESULTS, 8569b15).
PDL_BY_REQUESTS = ((2, "late"), (None, "early"))

# -- persistent row passes (kernels/sampling/row_launch.py gated_grid) --------------------------
# Programs per SM of a persistent pass's grid per capability major: what the PERSIST build keeps
# resident (sm_90: reduce 128-137 registers, select 128, refine 215; benchmarks/
# kernel_resources.py --capability 90), so a launch with nothing flagged is one wave of empty
# programs (RESULTS, PERSIST_FROM_ROWS). Other capabilities take SM12x's row (the 16-row
# select build takes more registers there; tests/kernels/test_sm12x_resources.py).
GATED_PER_SM = {9: {"reduce": 3, "select": 2, "refine": 1},
                12: {"reduce": 3, "select": 1, "refine": 1}}


@dataclass(frozen=True)
class SamplerTestHooks:
    """What tests set to reach paths toy vocabularies do not: never set in production."""
    tile: Optional[int] = None          # row tile (a power of two >= 16): several at V ~ 100
    scan_fallback: bool = True          # False: rows the brackets cannot resolve come out NaN
    thresholds: Optional[list] = None   # Markov: per step (rowf, rowi) copies after final
    needs: Optional[list] = None        # Markov: per step pick's need flags (candidate plan)


@dataclass(frozen=True)
class SamplerPlan:
    """Launch choices of the samplers. Defaults are what the runtime runs; every other value is
    a benchmark's A/B variant (benchmarks/sampler_cases.py) or a test's."""
    mode: str = "full"                  # the op's mode: MODES
    # programmatic dependent launch (sm_90+): True (the tables' choice), False, or a
    # tl_helpers.PDL_MODES key; -2 to -6 us a rejection call (RESULTS, 8569b15)
    pdl: Union[bool, str] = True
    # tokens per row-pass program; None: row_launch.row_tiling's choice (2048 / 4096 / 8192
    # by rows: rejection at B = 1 -7 / -12 us with 2048, RESULTS, 5af8e48)
    chunk: Optional[int] = None
    cap: int = CAND_CAP
    few_candidates: int = FEW_CANDIDATES
    # select neither reads nor bins the tiles wholly below the bracket (most of a peaked row)
    skip_below_bracket: bool = True
    # -- Markov sampler
    hist_bins: int = HIST_BINS
    refine_edges: int = REFINE_EDGES
    refine_passes: int = REFINE_PASSES
    logits_config: Optional[tuple] = None      # None: LOGITS_CONFIGS
    greedy_config: Optional[tuple] = None      # None: GREEDY_CONFIGS(_FP32)
    # odd steps walk W2 from the end, starting on what the last step left in the L2: 9-10 %
    # faster greedy at B = 64, ~11 of W2's 66 MB a step from the L2 (RESULTS)
    reverse_odd_steps: bool = True
    # top-p rows search only above the block maxima's floor: 1.06 -> 0.94 ms a call on
    # peaked rows at B = 64 (`ours-nofloor`, RESULTS)
    block_floor: bool = True
    # the Gumbel candidate pick: only rows whose candidate is outside the kept set are
    # searched (`ours-nocand`, RESULTS); False searches and samples every row
    # (tests read its thresholds)
    candidate: bool = True
    persistent: Optional[bool] = None          # gated launches; None: PERSIST_FROM_ROWS
    # -- rejection
    # the bound walk: only rows whose exact threshold is read are searched
    # (`ours-nobounds`, RESULTS, 8569b15)
    bounds: bool = True
    # draft rows' statistics and search on a side stream: the searches -18 to -33 us at B = 1
    # and 4, -55 to -95 us at B = 16 and 64 (RESULTS, b719fa9)
    overlap: bool = True
    # persistent searches: slower here (B = 64 375 -> 589 us peaked; ~2 rows a request to
    # search, RESULTS, PERSIST_FROM_ROWS)
    rejection_persistent: bool = False
    test_hooks: SamplerTestHooks = field(default_factory=SamplerTestHooks)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {self.mode!r}")
        pdl_mode(self.pdl, "early")             # raises "pdl must be ..." on a bad value
        if self.persistent is not None and not isinstance(self.persistent, bool):
            raise ValueError(f"persistent must be True, False or None, got {self.persistent!r}")
        if not isinstance(self.rejection_persistent, bool):
            raise ValueError(f"rejection_persistent must be True or False, got "
                             f"{self.rejection_persistent!r}")
        if not isinstance(self.refine_passes, int) or self.refine_passes < 1:
            raise ValueError(f"refine_passes must be an int >= 1, got {self.refine_passes!r}")
        check_pow2("hist_bins", self.hist_bins, 4, 128)
        check_pow2("refine_edges", self.refine_edges, 4, 128)
        if self.few_candidates != 0:    # pairwise builds a [few, few] int64 matrix a program
            check_pow2("few", self.few_candidates, 1, 64)

    def replace(self, **changes) -> "SamplerPlan":
        """A copy with `changes`: plan fields, or SamplerTestHooks fields (into test_hooks)."""
        hooks = {k: changes.pop(k) for k in list(changes)
                 if k in SamplerTestHooks.__dataclass_fields__}
        if hooks:
            changes["test_hooks"] = dataclasses.replace(self.test_hooks, **hooks)
        return dataclasses.replace(self, **changes)

    def check_rejection(self) -> None:
        """Rejection and plain sampling run the search with the module's HIST_BINS,
        REFINE_EDGES and REFINE_PASSES (their declared builds): a plan asking them for other
        Markov-only choices is refused, not silently ignored."""
        markov_only = ("hist_bins", "refine_edges", "refine_passes", "logits_config",
                       "greedy_config", "reverse_odd_steps", "block_floor", "candidate",
                       "persistent")
        changed = [f for f in markov_only if getattr(self, f) != getattr(PLAN, f)]
        if changed:
            raise ValueError(f"plan fields {changed} apply to the Markov sampler only")

    def markov_persist(self, B: int) -> bool:
        """Whether the Markov candidate plan's gated launches run persistent grids for B rows."""
        return B >= PERSIST_FROM_ROWS if self.persistent is None else self.persistent


def check_pow2(name: str, value, lo: int, hi: int) -> None:
    """A launch choice that must be a power of two in [lo, hi]."""
    if not isinstance(value, int) or value < lo or value > hi or value & (value - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {value!r}")


PLAN = SamplerPlan()
