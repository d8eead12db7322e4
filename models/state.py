"""Decode state: preallocated, fixed-shape tensors per request row, updated in place.

Every tensor has `max_rows + 1` rows: the last row is the *trash row*. Padded batch rows point
at it (reads are harmless garbage, outputs ignored) and their writes are masked (slot -1, which
the PyTorch references redirect to the trash row's last slot and the Triton kernels skip).

Rings are indexed by absolute position modulo their length. Their lengths leave room for one
forward's worth of tokens beyond what any reader needs, so rows written for drafts that get
rejected can never overwrite something still needed: they only hold positions that the next
step rewrites before anyone reads them (docs/model.md, "Decode state").

    SWA KV ring          sliding_window + max_step_tokens      (fp8_ds_mla style or float)
    compressor ring      coff·ratio + max_step_tokens          (fp32 kv | score)
    compressed KV        max_seq_len // ratio entries          (fp8_ds_mla style or float)
    indexer K            max_seq_len // 4 entries              (compute dtype)
    draft context ring   sliding_window (committed rows only)  (compute dtype)
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from dspark_compile.models.config import CacheConfig, ModelConfig, Precision


@dataclass(frozen=True)
class Spec:
    shape: tuple
    dtype: torch.dtype


def coff(ratio: int) -> int:
    return 2 if ratio == 4 else 1


def _kv_specs(prefix: str, rows: int, n: int, cfg: ModelConfig, prec: Precision) -> dict:
    if prec.kv_fp8:
        nope = cfg.nope_dim
        return {f"{prefix}_nope": Spec((rows, n, nope), torch.float8_e4m3fn),
                f"{prefix}_scale": Spec((rows, n, nope // 64), torch.uint8),
                f"{prefix}_rope": Spec((rows, n, cfg.qk_rope_head_dim), torch.bfloat16)}
    return {f"{prefix}_kv": Spec((rows, n, cfg.head_dim), prec.dtype)}


def state_specs(cfg: ModelConfig, cache: CacheConfig, prec: Precision) -> dict[str, Spec]:
    if prec.kv_fp8 and cfg.nope_dim % 64:
        raise ValueError(f"FP8 KV needs head_dim - qk_rope_head_dim ({cfg.nope_dim}) to be a multiple of 64")
    if cfg.has_draft and cache.max_step_tokens < cfg.dspark_block_size + 1:
        raise ValueError(f"CacheConfig.max_step_tokens={cache.max_step_tokens} < dspark_block_size + 1")
    R = cache.max_rows + 1
    acc = torch.float64 if prec.dtype == torch.float64 else torch.float32  # compressor state
    T = cache.max_step_tokens
    specs: dict[str, Spec] = {}
    for l, ratio in enumerate(cfg.compress_ratios):
        p = f"layers.{l}"
        specs.update(_kv_specs(f"{p}.swa", R, cfg.sliding_window + T, cfg, prec))
        if ratio:
            c = coff(ratio)
            ring = c * ratio + T
            specs[f"{p}.cmp_kv"] = Spec((R, ring, c * cfg.head_dim), acc)
            specs[f"{p}.cmp_score"] = Spec((R, ring, c * cfg.head_dim), acc)
            specs.update(_kv_specs(f"{p}.ckv", R, -(-cache.max_seq_len // ratio), cfg, prec))
        if ratio == 4:
            ring = 2 * ratio + T
            specs[f"{p}.idx_kv"] = Spec((R, ring, 2 * cfg.index_head_dim), acc)
            specs[f"{p}.idx_score"] = Spec((R, ring, 2 * cfg.index_head_dim), acc)
            specs[f"{p}.idx_k"] = Spec((R, -(-cache.max_seq_len // ratio), cfg.index_head_dim), prec.dtype)
    if cfg.has_draft:
        N, V = cfg.dspark_block_size, cfg.vocab_size
        for i in range(cfg.n_mtp_layers):
            specs[f"mtp.{i}.ctx"] = Spec((R, cfg.sliding_window, cfg.head_dim), prec.dtype)
        # per-row speculative-decoding state: next inputs [anchor, d1..dN], last committed
        # position, the drafts' logits (their distributions, for probabilistic rows) and sampling
        # parameters.
        specs["row.tokens"] = Spec((R, N + 1), torch.int64)
        specs["row.draft_logits"] = Spec((R, N, V), torch.float32)
    specs["row.last_pos"] = Spec((R,), torch.int64)
    specs["row.temperature"] = Spec((R,), torch.float32)
    specs["row.top_k"] = Spec((R,), torch.int64)
    specs["row.top_p"] = Spec((R,), torch.float32)
    specs["row.seed"] = Spec((R,), torch.int64)
    if cfg.has_draft:
        # the rejection op's verification per row: VERIFY_TOKEN or VERIFY_BLOCK
        # (kernels/sampling/reference.py; models/request.py SamplingParams.verify)
        specs["row.verify"] = Spec((R,), torch.int64)
    return specs


def state_bytes(cfg: ModelConfig, cache: CacheConfig, prec: Precision) -> int:
    """Bytes allocate_state would allocate, from the layout alone (nothing is allocated)."""
    total = 0
    for s in state_specs(cfg, cache, prec).values():
        n = s.dtype.itemsize
        for d in s.shape:
            n *= d
        total += n
    return total


def available_bytes(device) -> tuple[int, str]:
    """(bytes free for new tensors on `device`, where the number comes from). CPU: MemAvailable
    of /proc/meminfo (the kernel's estimate of what can be allocated without swapping), else
    the free physical pages (os.sysconf); CUDA: torch.cuda.mem_get_info's free bytes."""
    import os
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free), "free (torch.cuda.mem_get_info)"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available (MemAvailable, /proc/meminfo)"
    except OSError:
        pass
    return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
            "free (os.sysconf free physical pages)")


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def check_state_fits(cfg: ModelConfig, cache: CacheConfig, prec: Precision, device,
                     sizes: str = "") -> int:
    """Refuse, before allocating, a decode state larger than the memory free on `device`
    (ValueError naming the state's bytes, `sizes` -- the settings that chose them, e.g.
    "max_rows=64, max_seq_len=1024" -- and the free bytes); returns the state's bytes."""
    need = state_bytes(cfg, cache, prec)
    free, source = available_bytes(device)
    if need > free:
        what = sizes or (f"max_rows={cache.max_rows}, max_seq_len={cache.max_seq_len}, "
                         f"max_step_tokens={cache.max_step_tokens}")
        raise ValueError(f"the decode state for {what} needs {need} bytes ({_size(need)}); "
                         f"{torch.device(device)} has {free} bytes ({_size(free)}) {source}")
    return need


# The CacheConfig each state was allocated with, keyed by id() of its row.last_pos tensor (a
# state is a plain dict of tensors: torch.export takes it as an input pytree, so it carries no
# attributes). Entries go when that tensor does.
_CACHES: dict[int, CacheConfig] = {}


def allocate_state(cfg: ModelConfig, cache: CacheConfig, prec: Precision, device="cpu") -> dict:
    state = {name: torch.zeros(s.shape, dtype=s.dtype, device=device)
             for name, s in state_specs(cfg, cache, prec).items()}
    key = state["row.last_pos"]
    _CACHES[id(key)] = cache
    weakref.finalize(key, _CACHES.pop, id(key), None)
    return state


def state_limits(state: dict, cfg: ModelConfig) -> tuple[int, int | None]:
    """(max_step_tokens, max_seq_len) of `state`, as host ints from its CacheConfig or, for a
    state allocate_state did not make, from its shapes (no device read either way).

    From shapes: the SWA ring holds sliding_window + max_step_tokens entries; the compressed
    caches hold max_seq_len rounded up to their ratio (None when no layer compresses)."""
    cache = _CACHES.get(id(state["row.last_pos"]))
    if cache is not None:
        return cache.max_step_tokens, cache.max_seq_len
    ring = next(t for k, t in state.items() if k.startswith("layers.0.swa_")).shape[1]
    held = [state[f"layers.{l}.ckv_{'nope' if f'layers.{l}.ckv_nope' in state else 'kv'}"].shape[1] * r
            for l, r in enumerate(cfg.compress_ratios) if r]
    return ring - cfg.sliding_window, (min(held) if held else None)


def check_prefill(model, state: dict, row: int, prompt, chunk: int, speculative: bool) -> None:
    """The host-side checks of one prefill (prompt and lengths are host values): a chunk no
    larger than the state's max_step_tokens, positions within its max_seq_len and the model's
    RoPE tables, a real state row, token ids in the vocabulary. Raises ValueError naming the
    argument and both numbers; without them a forward writes past the caches' capacity and
    returns wrong logits (no error)."""
    cfg = model.cfg
    step_tokens, seq_len = state_limits(state, cfg)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"prefill: chunk must be a positive int, got {chunk!r}")
    if chunk > step_tokens:
        raise ValueError(f"prefill: chunk={chunk} exceeds the state's max_step_tokens="
                         f"{step_tokens} (tokens one forward may write)")
    rows = trash_row(state)
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < rows:
        raise ValueError(f"prefill: row={row!r} outside [0, {rows}) (the state's max_rows; row "
                         f"{rows} is the trash row)")
    L = len(prompt)
    if L == 0:
        raise ValueError("prefill: prompt is empty")
    bad = [t for t in prompt if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise ValueError(f"prefill: prompt token ids {bad[:5]} outside [0, vocab_size="
                         f"{cfg.vocab_size})")
    if seq_len is not None and L > seq_len:
        raise ValueError(f"prefill: prompt of {L} tokens exceeds the state's max_seq_len={seq_len}")
    if speculative and model.mtp is None:
        raise ValueError("prefill: speculative=True needs the DSpark draft (mtp.*) in the model")
    # a speculative prefill also drafts the first block, at positions L .. L + block - 1
    need = L + (cfg.dspark_block_size if speculative else 0)
    have = model.rope_main.shape[0]
    if need > have:
        raise ValueError(f"prefill: prompt of {L} tokens"
                         + (f" + a draft block of {cfg.dspark_block_size}" if speculative else "")
                         + f" needs {need} positions, the model's RoPE tables hold {have} "
                         "(max_positions)")


def trash_row(state: dict) -> int:
    return state["row.last_pos"].shape[0] - 1


def snapshot_state(state: dict) -> dict:
    """A copy of every state tensor (to run one step twice from the same point)."""
    return {k: v.clone() for k, v in state.items()}


def restore_state(state: dict, snapshot: dict) -> None:
    """Copy `snapshot` back into the state's own tensors, in place (CUDA graphs hold them)."""
    for k, v in state.items():
        v.copy_(snapshot[k])
