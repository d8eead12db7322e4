"""Which tensor of the native checkpoint each of `tp` ranks holds, the per-rank loader, and the
sharded reference model (docs/model.md, "Tensor parallelism"; the collectives are
models/parallel.py's).

The table (`SPLITS`, matched on a tensor's name inside its layer; everything else replicated):

    tensor                      split             per rank         collective
    embed.weight                vocab rows        V / tp           masked lookup, all-reduce [M, D]
                                                                   (exact: one nonzero term)
    head.weight                 vocab rows        V / tp           logits [M, V / tp] all-gathered
                                                                   (bitwise: one dot product each)
    attn.wq_b.{weight,scale}    rows = heads      H / tp heads     -
    attn.attn_sink              heads             H / tp           -
    attn.wo_a.{weight,scale}    rows = o_groups   G / tp groups    - (a group reads its own heads)
    attn.wo_b.{weight,scale}    columns           G / tp o_lora    all-reduce [M, D]
    ffn.shared_experts.w1/w3    rows              I / tp           -
    ffn.shared_experts.w2       columns           I / tp           summed with the routed partial
    ffn.experts.E.*             whole experts     E / tp experts   one all-reduce [M, D] for the
                                                                   MoE's routed + shared
    wq_a, wkv, q_norm, kv_norm, compressor, indexer, gate, mHC, norms, main_proj, the Markov
    and confidence heads: replicated

Routed experts whole per rank (expert parallel) rather than every expert's I / tp slice: on
one H100 each rank's `moe_experts` share at tp = 2 (Flash dims, uniform top-6 routing) takes
123 / 608 / 687 µs at B = 1 / 16 / 64 for the slower rank against 120 / 597 / 710 µs for the
intermediate split (benchmarks/results/h100_tp_serve_2026-12-07): a tie within 3 %, so the
split whose per-expert tiles stay the kernel's is kept; a skewed real routing (the expert
split pays the busier rank) is what would change the choice.

The shared latent KV is replicated, with its caches: it is ONE 512-d head (MQA) that every query
head reads, so each rank needs all of it; split, every attention would first all-gather it. Its
projection is [512, D] (4 MB of FP8 at Flash), its caches ~1/64 of what a per-head KV would be.
The compressor and the lightning indexer read that latent and are replicated with it, so each
rank computes the same top-k from the same bits: no collective, identical on every rank.

FP8 block-scaled splits keep the 128 x 128 scale blocks whole: a split whose per-rank rows or
columns are not a multiple of 128 is refused, naming the tensor (`check_splits`). The tiny
preset's wo_a (o_lora_rank 64: two groups share a block) is refused at tp = 2 for that reason.

The LM head: gathering the logits moves M x V fp32 (Flash, B = 1 verify of 6 tokens: 3.1 MB,
each rank sending 1.55 MB); reducing row statistics instead (max / argmax / sum-exp per shard)
moves a few bytes a token but needs every sampler (top-k, top-p, rejection's residual, the
Markov draft sampler) rewritten over shards. The reference gathers, so the samplers are
unchanged and every rank samples from the same bits with the same Philox keys. At B = 16 the
gather is 24.8 MB a rank per verify where statistics would stay a few KB: the exported step's
choice (issue 53 item 2).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dspark_compile.kernels.act_quant import rmsnorm_reference
from dspark_compile.models.attention import Attention
from dspark_compile.models.checkpoint import CheckpointError, checked_layout, validate_tid2eid
from dspark_compile.models.config import ModelConfig, Precision
from dspark_compile.models.linear import FP8_BLOCK, acc_dtype, bf16_linear
from dspark_compile.models.moe import MoE
from dspark_compile.models.parallel import ParallelConfig, ParallelError
from dspark_compile.models.schema import checkpoint_schema
from dspark_compile.models.target import DeepseekV4
from dspark_compile.models.weights import load_native, model_name

REPLICATE, ROWS, COLS, EXPERT = "replicate", "rows", "columns", "expert"

# (pattern on the name inside its layer, split, what the split divides)
SPLITS = (
    (r"(embed|head)\.weight", ROWS, "vocab_size"),
    (r"attn\.wq_b\.(weight|scale)", ROWS, "num_attention_heads"),
    (r"attn\.attn_sink", ROWS, "num_attention_heads"),
    (r"attn\.wo_a\.(weight|scale)", ROWS, "o_groups"),
    (r"attn\.wo_b\.(weight|scale)", COLS, "o_groups"),
    (r"ffn\.shared_experts\.w[13]\.(weight|scale)", ROWS, "moe_intermediate_size"),
    (r"ffn\.shared_experts\.w2\.(weight|scale)", COLS, "moe_intermediate_size"),
    (r"ffn\.experts\.\d+\.w[123]\.(weight|scale)", EXPERT, "n_routed_experts"),
)
_COMPILED = tuple((re.compile(p + "$"), k, f) for p, k, f in SPLITS)
_LAYER = re.compile(r"^(?:layers|mtp)\.\d+\.")
_EXPERT_ID = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Split:
    kind: str           # REPLICATE | ROWS | COLS | EXPERT
    field: str = ""     # the config field the split divides


def split_of(name: str) -> Split:
    """How the native checkpoint tensor `name` is split over the ranks."""
    local = _LAYER.sub("", name)
    for pat, kind, field in _COMPILED:
        if pat.match(local):
            return Split(kind, field)
    return Split(REPLICATE)


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config a rank's modules are built with: H / tp heads in G / tp output groups (the
    attention modules' shapes follow); the vocab, the experts and the intermediate size keep the
    full values (the gate scores all experts; the buffers are resized by build_rank_model)."""
    for field in ("num_attention_heads", "o_groups", "n_routed_experts", "vocab_size"):
        if getattr(cfg, field) % tp:
            raise ParallelError(f"config field '{field}' = {getattr(cfg, field)} does not split "
                                f"over tp={tp} ranks")
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                               o_groups=cfg.o_groups // tp)


def check_splits(cfg: ModelConfig, tp: int, schema: dict) -> None:
    """Every split divides its tensor over tp ranks, and no FP8 split cuts a 128 x 128 scale
    block; else ParallelError naming the first tensor (schema order) and the numbers."""
    if tp < 1 or tp & (tp - 1):
        raise ParallelError(f"tp={tp}: the rank count must be a power of two")
    rank_config(cfg, tp)
    for name, spec in schema.items():
        s = split_of(name)
        if s.kind in (REPLICATE, EXPERT):
            continue
        dim = 0 if s.kind == ROWS else 1
        n = spec.shape[dim]
        if n % tp:
            raise ParallelError(f"tensor '{name}': {s.kind} {n} do not split over tp={tp} ranks")
        if spec.kind == "fp8_weight" and (n // tp) % FP8_BLOCK:
            raise ParallelError(
                f"tensor '{name}' {list(spec.shape)}: tp={tp} gives each rank {n // tp} "
                f"{s.kind}, which cuts its {FP8_BLOCK} x {FP8_BLOCK} scale blocks (a split must "
                f"hold whole blocks; '{s.field}' = {getattr(cfg, s.field)})")


def rank_index(name: str, shape: tuple, pc: ParallelConfig, n_experts: int):
    """The slice tuple of `name` this rank holds; None when it holds none of it (another
    rank's expert)."""
    s = split_of(name)
    if s.kind == REPLICATE:
        return ()
    if s.kind == EXPERT:
        lo, hi = pc.span(n_experts, "n_routed_experts")
        e = int(_EXPERT_ID.search(name).group(1))
        return () if lo <= e < hi else None
    dim = 0 if s.kind == ROWS else 1
    lo, hi = pc.span(shape[dim], f"tensor '{name}'")
    return (slice(lo, hi),) if dim == 0 else (slice(None), slice(lo, hi))


def local_name(name: str, pc: ParallelConfig, n_experts: int) -> str:
    """A routed expert's name with its index on this rank (E - lo); other names unchanged."""
    m = _EXPERT_ID.search(name)
    if m is None or split_of(name).kind != EXPERT:
        return name
    lo, _ = pc.span(n_experts, "n_routed_experts")
    return f"{name[:m.start(1)]}{int(m.group(1)) - lo}{name[m.end(1):]}"


def load_rank_tensors(path: str | Path, pc: ParallelConfig, include_draft: bool = True):
    """(config, {name: this rank's tensor}, bytes read) from a native checkpoint directory: every
    header checked as load_checkpoint does, then only this rank's slices read (safetensors'
    get_slice: a row split reads one contiguous range, another rank's expert nothing). Routed
    experts keep their global names; `local_name` renames them for the rank model."""
    root = Path(path)
    cfg, found, schema = checked_layout(root, None, include_draft)
    check_splits(cfg, pc.tp, schema)
    by_file: dict[str, list[str]] = {}
    for name, (file, _, _) in found.items():
        by_file.setdefault(file, []).append(name)
    out: dict[str, torch.Tensor] = {}
    read = 0
    for file, names in sorted(by_file.items()):
        with safe_open(str(root / file), framework="pt", device="cpu") as f:
            for name in names:
                index = rank_index(name, schema[name].shape, pc, cfg.n_routed_experts)
                if index is None:
                    continue
                try:
                    t = f.get_slice(name)[index] if index else f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"tensor '{name}' in {file}: cannot read its data "
                                          f"({e})", tensor=name, file=file) from None
                read += t.numel() * t.element_size()
                out[name] = t
    validate_tid2eid(out, cfg)
    return cfg, {n: out[n] for n in schema if n in out}, read


class ParallelDeepseekV4(DeepseekV4):
    """One rank's share of the target (+ draft): the modules built from rank_config, the split
    buffers resized to this rank's shapes, and the collectives added where a partial result
    leaves a split (module docstring's table):

        embed_streams   masked vocab-parallel lookup, all_reduce [M, D] (compute dtype)
        attn.wo_b       row-parallel output, all_reduce [M, D] (accumulation dtype), target
                        and draft attention
        ffn.gate        expert ids outside this rank's [lo, hi) -> -1 (the op skips them)
        ffn             routed (own experts) + shared (own I / tp) partials, MoE.reduce:
                        all_reduce [M, D] (accumulation dtype)
        logits          local vocab block, all_gather -> [M, V] (accumulation dtype)

    `cfg` is rank_config's (H / tp heads); `full_cfg` the checkpoint's."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, prec: Precision,
                 max_positions: int, with_draft: bool = True):
        rank_cfg = rank_config(cfg, pc.tp)
        # built with E / tp experts, so no rank ever allocates all of them (Flash: 147 GiB of
        # MXFP4 across the layers); the gates' [E, D] weight and [E] bias are re-made at all E
        # by build_rank_model's resize (the gate scores every expert)
        build_cfg = dataclasses.replace(rank_cfg, n_routed_experts=cfg.n_routed_experts // pc.tp)
        super().__init__(build_cfg, prec, max_positions, with_draft)
        self.cfg, self.full_cfg, self.pc = rank_cfg, cfg, pc
        self.vocab_lo, _ = pc.span(cfg.vocab_size, "vocab_size")
        self.expert_lo, _ = pc.span(cfg.n_routed_experts, "n_routed_experts")
        # the split buffers at this rank's shapes from the start (the gates at all E, the vocab
        # rows and the shared expert's I at 1 / tp), so a model built on the meta device has
        # the shard's shapes (engine_dir/fields.py checks an engine's weights against it)
        _resize_split_buffers(self, rank_shapes(cfg, pc, with_draft))
        # row-parallel partials stay in the accumulation dtype until summed across ranks,
        # then round once to the compute dtype, as the unsharded K-sum does (bf16 compute:
        # [M, D] fp32 moves 2x the bf16 bytes, 96 KB at B = 1's 6 verify tokens: latency-bound)
        acc = acc_dtype(prec.dtype)
        for m in self.modules():
            if isinstance(m, Attention):
                m.wo_b.out_dtype = acc
                m.wo_b.register_forward_hook(self._reduce_hook)
            elif isinstance(m, MoE):
                m.gate.register_forward_hook(self._local_experts_hook)
                m.shared_experts.w2.out_dtype = acc
                m.reduce = pc.all_reduce

    def _reduce_hook(self, module, args, out):
        return self.pc.all_reduce(out).to(self.prec.dtype)

    def _local_experts_hook(self, module, args, out):
        idx, w = out
        n = self.full_cfg.n_routed_experts // self.pc.tp
        local = idx - self.expert_lo
        mine = (local >= 0) & (local < n)
        return torch.where(mine, local, torch.full_like(local, -1)), w

    def embed_streams(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.embed.weight
        local = tokens - self.vocab_lo
        mine = (local >= 0) & (local < w.shape[0])
        e = w[local.clamp(0, w.shape[0] - 1)].to(self.prec.dtype)
        e = self.pc.all_reduce(torch.where(mine[:, None], e, torch.zeros_like(e)))
        return e.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def logits(self, X, hc_head, norm_weight):
        h = rmsnorm_reference(hc_head(X), norm_weight, self.cfg.rms_norm_eps)
        local = bf16_linear(h, self.head.weight, self.prec.dtype, acc_dtype(self.prec.dtype))
        return self.pc.all_gather_last(local)


@torch.no_grad()
def build_rank_model(path: str | Path, pc: ParallelConfig, prec: Precision | None = None,
                     max_positions: int = 4096, with_draft: bool = True, device="cpu"):
    """This rank's ParallelDeepseekV4 from a native checkpoint directory, reading only its
    bytes; returns (model, bytes read)."""
    prec = prec or Precision()
    cfg, tensors, read = load_rank_tensors(path, pc, include_draft=with_draft)
    with torch.device(device):
        model = ParallelDeepseekV4(cfg, pc, prec, max_positions, with_draft)
    named = {local_name(n, pc, cfg.n_routed_experts): t for n, t in tensors.items()}
    _resize_split_buffers(model, {n: tuple(t.shape) for n, t in named.items()})
    load_native(model, named)
    return model.eval(), read


def rank_shapes(cfg: ModelConfig, pc: ParallelConfig, with_draft: bool = True) -> dict:
    """{native name, routed experts by their local index: shape} of every checkpoint tensor
    this rank holds, from the schema alone."""
    out = {}
    for name, spec in checkpoint_schema(cfg).items():
        if not with_draft and name.startswith("mtp."):
            continue
        index = rank_index(name, spec.shape, pc, cfg.n_routed_experts)
        if index is None:
            continue
        shape = list(spec.shape)
        for d, sl in enumerate(index):
            if sl != slice(None):
                shape[d] = sl.stop - sl.start
        out[local_name(name, pc, cfg.n_routed_experts)] = tuple(shape)
    return out


def _resize_split_buffers(model: torch.nn.Module, named: dict[str, tuple]) -> None:
    """The buffers built at another size re-made at the shapes {native name: shape} (the gates
    at all E, the vocab rows and the shared expert's I at their 1 / tp), so load_native's
    shape check holds."""
    shapes: dict[str, tuple] = {}
    for native, shape in named.items():
        name, idx = model_name(native)
        shape = tuple(shape)
        if idx is not None:
            n = max(shapes.get(name, (0,))[0], idx + 1)
            shape = (n, *shape)
        shapes[name] = shape
    for name, buf in model.named_buffers():
        if name in shapes and tuple(buf.shape) != shapes[name]:
            mod_name, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            setattr(mod, attr, torch.zeros(shapes[name], dtype=buf.dtype, device=buf.device))


# ---- plans from the config alone (nothing loaded) --------------------------------------------

def rank_weight_bytes(cfg: ModelConfig, tp: int, include_draft: bool = True) -> int:
    """Checkpoint bytes one rank holds (every rank the same: equal splits), from the schema;
    optional tensors counted (a checkpoint may hold them)."""
    schema = checkpoint_schema(cfg)
    check_splits(cfg, tp, schema)
    total = 0
    for name, spec in schema.items():
        if not include_draft and name.startswith("mtp."):
            continue
        n = spec.dtype.itemsize
        for d in spec.shape:
            n *= d
        total += n if split_of(name).kind == REPLICATE else n // tp
    return total


@dataclass(frozen=True)
class Collective:
    site: str        # where in the forward
    op: str          # "all_reduce" | "all_gather"
    count: int       # calls per forward
    nbytes: int      # bytes each rank contributes per call


def forward_collectives(cfg: ModelConfig, tp: int, tokens: int, dtype: torch.dtype,
                        draft: bool = False) -> list[Collective]:
    """The collectives of one target forward over `tokens` tokens (all rows together), or of
    one draft forward (`draft`: its n_mtp_layers stages), at compute dtype `dtype`: the sites
    ParallelDeepseekV4 adds. An all_reduce of S bytes moves S out of and (tp - 1) S into each
    rank (models/parallel.py); the logits' all_gather each rank's V / tp block."""
    if tp == 1:
        return []
    D, acc = cfg.hidden_size, acc_dtype(dtype)
    layers = cfg.n_mtp_layers if draft else cfg.num_hidden_layers
    row = tokens * D
    return [Collective("embedding", "all_reduce", 1, row * dtype.itemsize),
            Collective("attention wo_b", "all_reduce", layers, row * acc.itemsize),
            Collective("MoE (routed + shared)", "all_reduce", layers, row * acc.itemsize),
            Collective("LM head logits", "all_gather", 1,
                       tokens * (cfg.vocab_size // tp) * acc.itemsize)]
