"""Each rank's device memory, planned from the config alone before anything is loaded
(docs/model.md, "Tensor parallelism", "Memory plan"; issue 53 item 4).

    weights        every checkpoint tensor this rank holds, split as models/sharding.py splits
                   it (heads, o_groups, the shared expert's I, whole experts, vocab rows; the
                   rest replicated), in the bytes the engine stores: the checkpoint's own dtypes
                   (FP8 e4m3 + E8M0 per 128 x 128 block, MXFP4 nibbles + E8M0 per 32, bf16,
                   fp32, int64 hash tables). The engine changes no size: E8M0 is held as uint8
                   and the experts' kernel layout is a permutation (kernels/moe_layout.py).
    RoPE tables    not checkpoint tensors: the engine's weights file holds one fp32
                   [positions, rope_dim] table per attention module plus `rope_main`
                   (engine_dir/weights.py stores each module FQN's tensor; the build shares
                   one, the load reads them back apart), and the eager prefill model rebuilds
                   its two (runtime/engine.py _reference_model).
    decode state   models/state.py state_specs' buffers at max_rows + 1 rows (the trash row):
                   replicated on every rank, as sharding.py replicates the one latent KV head
                   and its caches (each rank's heads read all of it).
    graph pool     ESTIMATE: one private pool shared by every captured program, largest first;
                   smaller ones reuse it (the one measurement: buckets 16, 4, 1 added 0 bytes
                   after bucket 64's 28 MiB, benchmarks/results/README.md "Engine"), so the pool
                   is the peak activation bytes of the program with the most tokens.
    workspace      ESTIMATE: the CUDA context and loaded kernels, NCCL's buffers at tp > 1.

Nothing here allocates: shapes and dtypes only. `check_fits` refuses a plan larger than a
device, naming the part, the bytes and the device's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark_compile.models.config import ModelConfig, Precision
from dspark_compile.models.linear import acc_dtype
from dspark_compile.models.parallel import ParallelConfig, ParallelError
from dspark_compile.models.schema import checkpoint_schema
from dspark_compile.models.sharding import REPLICATE, check_splits, rank_index, split_of
from dspark_compile.models.state import state_specs

MiB, GiB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """A target device's memory: `total` bytes, of which `reserved` are not the engine's (the
    OS and the host side of the process on a unified-memory device)."""
    name: str
    total: int
    reserved: int = 0
    source: str = ""

    @property
    def usable(self) -> int:
        return self.total - self.reserved


DEVICES = {
    # 96 GB of GDDR7; 97,887 MiB is the total nvidia-smi lists for the card (not measured here)
    "rtx-pro-6000": DeviceMemory("rtx-pro-6000", 97887 * MiB, 0,
                                 "97,887 MiB as nvidia-smi lists the card (not measured here)"),
    # DGX Spark: 128 GB (decimal) of LPDDR5x that the CPU and the GPU share; the OS and the
    # process's own host side (Python, torch, the tokenizer, the HTTP server) live in it too
    "gb10": DeviceMemory("gb10", 128 * 10**9, 8 * GiB,
                         "128 GB unified LPDDR5x, 8 GiB left to the OS and the host side "
                         "(an estimate)"),
    # torch's total_memory on the lent cards (benchmarks/results/*/step.json "environment")
    "h200": DeviceMemory("h200", 150_109_880_320, 0,
                         "torch total_memory, benchmarks/results/h200_step_flash_aten_2026-12-01"),
    "h100": DeviceMemory("h100", 85_017_493_504, 0,
                         "torch total_memory, benchmarks/results/h100_step_2026-12-06"),
}

# workspace estimates (no measurement at Flash size yet; the load records its pool,
# manifest "runtime_load"):
# the CUDA context with lazily loaded modules is ~0.5 GiB under torch 2.x on H100 / H200; the
# engine's Triton kernels and the caching allocator's unused tails of its segments add to it
CONTEXT_BYTES = 1 * GiB
# NCCL between two GPUs: per peer and channel a send and a receive buffer of each protocol
# (Simple's NCCL_BUFFSIZE is 4 MiB) over up to 32 channels on NVLink: ~0.3 GiB, rounded up
NCCL_BYTES = GiB // 2
# the graph pool formula counts the largest live activations only; the one measured pool
# (tiny fp32, B = 64: 28 MiB) is 3.2x the formula's 9.2 MB, from the allocator's 2 MiB /
# 20 MiB segment rounding and lifetimes that overlap beyond the ones counted: 4x stays above it
POOL_FACTOR = 4


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's bytes by category (every rank holds the same: equal splits)."""
    tp: int
    max_rows: int
    max_seq_len: int
    max_step_tokens: int
    weights: dict = field(default_factory=dict)       # group -> bytes (exact)
    replicated_weights: int = 0                       # of which every rank holds all
    rope_tables: int = 0                              # exact for the current engine format
    state: dict = field(default_factory=dict)         # buffer group -> bytes (exact)
    graph_pool: int = 0                               # estimate
    graph_pool_program: str = ""                      # the program that sizes it
    workspace: dict = field(default_factory=dict)     # part -> bytes (estimate)

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def state_bytes(self) -> int:
        return sum(self.state.values())

    @property
    def workspace_bytes(self) -> int:
        return sum(self.workspace.values())

    def categories(self) -> list[tuple[str, int]]:
        """(category, bytes) in the order the table prints them; the last ones are estimates."""
        return [("weights", self.weight_bytes), ("RoPE tables", self.rope_tables),
                ("decode state", self.state_bytes),
                ("CUDA graph pool (estimate)", self.graph_pool),
                ("workspace (estimate)", self.workspace_bytes)]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.categories())


# ---- the plan ------------------------------------------------------------------------------

def check_tp(tp) -> int:
    """tp as an int, or ValueError naming it: a power of two >= 1 (the shapes decide which
    divide: check_splits)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or tp & (tp - 1):
        raise ValueError(f"tp must be a power of two >= 1 (1, 2, 4, 8), got {tp!r}")
    return tp


def memory_plan(cfg: ModelConfig, bc, tp: int = 1) -> MemoryPlan:
    """The plan of one rank for the build settings `bc` (BuildConfig: max_rows, max_seq_len,
    prefill chunks, buckets, dtype, kv_fp8, target_programs) at `tp` ranks. A tp whose splits
    do not divide the shapes, or would cut a 128 x 128 scale block, raises ValueError naming
    the tensor (sharding.check_splits)."""
    tp = check_tp(tp)
    schema = checkpoint_schema(cfg)
    try:
        check_splits(cfg, tp, schema)
    except ParallelError as e:
        raise ValueError(f"tp={tp}: {e}") from None
    block = cfg.dspark_block_size
    cache = bc.cache(block)
    prec = bc.precision()
    weights, replicated = rank_weights(cfg, tp, schema)
    pool, program = graph_pool_estimate(cfg, bc, tp)
    workspace = {"CUDA context and kernels": CONTEXT_BYTES}
    if tp > 1:
        workspace["NCCL buffers"] = NCCL_BYTES
    return MemoryPlan(tp=tp, max_rows=cache.max_rows, max_seq_len=cache.max_seq_len,
                      max_step_tokens=cache.max_step_tokens, weights=weights,
                      replicated_weights=replicated,
                      rope_tables=rope_table_bytes(cfg, bc.rope_positions(block),
                                                   bc.max_seq_len + block + 2),
                      state=state_groups(cfg, cache, prec), graph_pool=pool,
                      graph_pool_program=program, workspace=workspace)


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _weight_group(name: str, spec) -> str:
    if spec.kind.startswith("mxfp4"):
        return "routed experts (MXFP4 + E8M0 per 32)"
    if spec.kind.startswith("fp8"):
        return "FP8 linears (+ E8M0 per 128 x 128)"
    if name in ("embed.weight", "head.weight"):
        return "embedding + LM head (bf16)"
    if spec.kind == "tid2eid":
        return "hash-routing tables (int64)"
    if spec.dtype == torch.bfloat16:
        return "other bf16 (gates, compressors, norms, Markov head)"
    return f"other {str(spec.dtype).replace('torch.', '')} (mHC, sinks, biases, APE)"


def rank_weights(cfg: ModelConfig, tp: int, schema: dict | None = None) -> tuple[dict, int]:
    """({group: bytes}, replicated bytes) of rank 0's weights: each tensor's slice as
    sharding.rank_index cuts it (a row / column split's 1 / tp, its own E / tp experts whole,
    the rest replicated). Every rank holds the same bytes (the splits are equal)."""
    schema = schema if schema is not None else checkpoint_schema(cfg)
    pc = ParallelConfig(0, tp)
    groups: dict[str, int] = {}
    replicated = 0
    for name, spec in schema.items():
        index = rank_index(name, spec.shape, pc, cfg.n_routed_experts)
        if index is None:
            continue                                   # another rank's expert
        shape = list(spec.shape)
        for dim, s in enumerate(index):
            lo, hi, _ = s.indices(shape[dim])
            shape[dim] = hi - lo
        n = _nbytes(shape, spec.dtype)
        g = _weight_group(name, spec)
        groups[g] = groups.get(g, 0) + n
        if split_of(name).kind == REPLICATE:
            replicated += n
    return groups, replicated


def rope_table_bytes(cfg: ModelConfig, engine_positions: int, eager_positions: int) -> int:
    """fp32 [positions, qk_rope_head_dim] tables: the engine's one per attention module (target
    layers and draft stages) plus rope_main at `engine_positions` (BuildConfig.rope_positions),
    and the eager prefill model's main and compressed tables at `eager_positions`."""
    row = cfg.qk_rope_head_dim * 4
    modules = cfg.num_hidden_layers + (cfg.n_mtp_layers if cfg.has_draft else 0) + 1
    return modules * engine_positions * row + 2 * eager_positions * row


def _state_group(name: str) -> str:
    if name.startswith("row."):
        return "row fields (tokens, draft logits, sampling)"
    if name.startswith("mtp."):
        return "draft context rings"
    key = name.split(".", 2)[2]
    for prefix, group in (("swa_", "SWA KV rings"), ("ckv_", "compressed KV"),
                          ("cmp_", "compressor rings"), ("idx_k", "indexer keys"),
                          ("idx_", "indexer compressor rings")):
        if key.startswith(prefix):
            return group
    return "other"


def state_groups(cfg: ModelConfig, cache, prec: Precision) -> dict:
    """{group: bytes} of allocate_state's buffers (state_specs' shapes; nothing allocated)."""
    out: dict[str, int] = {}
    for name, s in state_specs(cfg, cache, prec).items():
        g = _state_group(name)
        out[g] = out.get(g, 0) + _nbytes(s.shape, s.dtype)
    return out


# ---- graph pool (estimate) -------------------------------------------------------------------

def _layer_token_bytes(cfg: ModelConfig, tp: int, acc: int) -> int:
    """The largest activations one token holds inside a layer, in the accumulation dtype
    (`acc` bytes), all counted as live at once (an upper bound on their overlap):
    the hc_mult residual streams three times (in, out, mHC's mix), the q_lora latent, q and the
    attention output of this rank's H / tp heads, the G / tp o_lora groups, the indexer's q,
    and the MoE's gate / up of k experts, their k outputs and the shared expert's I / tp."""
    streams = 3 * cfg.hc_mult * cfg.hidden_size
    attention = (cfg.q_lora_rank + 2 * (cfg.num_attention_heads // tp) * cfg.head_dim
                 + (cfg.o_groups // tp) * cfg.o_lora_rank)
    indexer = cfg.index_n_heads * cfg.index_head_dim
    k = cfg.num_experts_per_tok
    moe = k * 2 * cfg.moe_intermediate_size + k * cfg.hidden_size \
        + 2 * cfg.moe_intermediate_size // tp
    return (streams + attention + indexer + moe) * acc


def _head_token_bytes(cfg: ModelConfig, tp: int, acc: int) -> int:
    """A sampled token's logits [V] (acc dtype), their all-gathered copy at tp > 1
    (sharding.py: the logits are gathered), and the samplers' fp32 probabilities and
    residual."""
    V = cfg.vocab_size
    return V * acc * (2 if tp > 1 else 1) + 2 * V * 4


def graph_pool_estimate(cfg: ModelConfig, bc, tp: int) -> tuple[int, str]:
    """(bytes, program): POOL_FACTOR x the peak activations of the captured program with the
    most: a step at the largest bucket B (B (N + 1) verify tokens through the layers and the
    head, B N draft tokens through the head), a target-only step (B tokens), a prefill chunk of
    C tokens (the layers; the head at one token: target.py logits_at). Each program through a
    C4 layer also holds the indexer's fp32 score scratch [tokens, max_seq_len / 4]
    (kernels/indexer_topk.py)."""
    acc = acc_dtype(bc.precision().dtype).itemsize
    layer, head = _layer_token_bytes(cfg, tp, acc), _head_token_bytes(cfg, tp, acc)
    entries = -(-bc.max_seq_len // 4) if 4 in cfg.compress_ratios else 0
    N, B = cfg.dspark_block_size, max(bc.buckets)
    candidates = [(f"step, bucket {B}", B * (N + 1), B * (N + 1) + B * N)]
    if bc.target_programs:
        candidates.append((f"target-only step, bucket {B}", B, B))
    if bc.prefill_chunks:
        C = max(bc.prefill_chunks)
        candidates.append((f"prefill chunk {C}", C, 1))
    best = ("", 0)
    for what, layer_tokens, head_tokens in candidates:
        peak = max(layer_tokens * layer, head_tokens * head) + layer_tokens * entries * 4
        if peak > best[1]:
            best = (what, peak)
    return POOL_FACTOR * best[1], best[0]


# ---- the check and the table -------------------------------------------------------------------

def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def check_fits(plan: MemoryPlan, device: DeviceMemory) -> None:
    """ValueError, one line, when the plan's total exceeds the device's usable bytes: the
    largest category, every category's bytes and the device's."""
    if plan.total <= device.usable:
        return
    parts = ", ".join(f"{name} {_gib(n)}" for name, n in plan.categories())
    have = _gib(device.usable) + (f" ({_gib(device.total)} less {_gib(device.reserved)} "
                                  "reserved)" if device.reserved else "")
    if plan.weight_bytes > device.usable:
        why = (f"its weights alone ({_gib(plan.weight_bytes)} at tp={plan.tp}) exceed it: "
               "raise --tp")
    else:
        why = (f"{_gib(plan.total - device.usable)} short: lower --max-rows or --max-seq-len, "
               "or raise --tp")
    raise ValueError(
        f"memory plan: each of the {plan.tp} rank(s) needs {_gib(plan.total)} ({parts}) for "
        f"max_rows={plan.max_rows} x max_seq_len={plan.max_seq_len}; the device {device.name} "
        f"has {have}: {why}")


def format_plan(plan: MemoryPlan, device: DeviceMemory | None = None) -> str:
    """The plan as a table: each category's bytes and GiB, its groups indented below it."""
    rows: list[tuple[str, int]] = []
    sub = {"weights": plan.weights, "decode state": plan.state,
           "workspace (estimate)": plan.workspace}
    for name, n in plan.categories():
        rows.append((name, n))
        for g, b in sorted(sub.get(name, {}).items(), key=lambda kv: -kv[1]):
            rows.append((f"  {g}", b))
        if name == "weights":
            rows.append(("  (of which replicated on every rank)", plan.replicated_weights))
        if name.startswith("CUDA graph pool") and plan.graph_pool_program:
            rows.append((f"  (sized by the {plan.graph_pool_program})", plan.graph_pool))
    rows.append(("total per rank", plan.total))
    if device is not None:
        rows.append((f"device {device.name} (usable)", device.usable))
        rows.append(("headroom", device.usable - plan.total))
    width = max(len(r[0]) for r in rows)
    head = (f"memory plan per rank: tp={plan.tp}, max_rows={plan.max_rows} x max_seq_len="
            f"{plan.max_seq_len}, {plan.max_step_tokens} tokens per forward")
    lines = [head, f"  {'category':<{width}}  {'bytes':>18}  {'GiB':>8}"]
    for name, n in rows:
        lines.append(f"  {name:<{width}}  {n:>18,}  {n / GiB:>8.2f}")
    return "\n".join(lines)


def device_memory(name: str | None = None, gib: float | None = None, cuda_device=None
                  ) -> DeviceMemory | None:
    """The target device: `gib` GiB (--device-memory-gib), a named preset (DEVICES), or the
    total memory of `cuda_device` when building on CUDA; None when none is known (a CPU build:
    its state check is models/state.py check_state_fits)."""
    if gib is not None:
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < 1 << 20:
            raise ValueError(f"--device-memory-gib must be a positive number of GiB, got {gib!r}")
        return DeviceMemory(f"of {gib:g} GiB", int(gib * GiB), 0, "--device-memory-gib")
    if name is not None:
        if name not in DEVICES:
            raise ValueError(f"--target-device must be one of {', '.join(DEVICES)}, got {name!r}")
        return DEVICES[name]
    if cuda_device is not None and torch.device(cuda_device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(cuda_device))
        return DeviceMemory(f"{torch.device(cuda_device)} ({props.name})", int(props.total_memory),
                            0, "torch.cuda.get_device_properties total_memory")
    return None


def max_rows_that_fit(cfg: ModelConfig, bc, tp: int, device: DeviceMemory) -> int:
    """The most rows (max_rows, buckets up to it) at bc's max_seq_len that fit `device`; 0 when
    not even one does. The state grows linearly with rows, so a bisection over [1, 4096]."""
    import dataclasses

    def fits(rows: int) -> bool:
        b = dataclasses.replace(bc, max_rows=rows,
                                buckets=tuple(x for x in bc.buckets if x <= rows) or (rows,))
        return memory_plan(cfg, b, tp).total <= device.usable

    if not fits(1):
        return 0
    lo, hi = 1, 4096
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
