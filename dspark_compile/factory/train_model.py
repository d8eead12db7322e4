"""The target and the DSpark draft in the form training needs: fp32 parameters, whole sequences.

The reference models (models/target.py, models/draft.py) hold the checkpoint's stored formats
and run one step at a time over a decode state. Training needs the same function of the same
weights, differentiable and over whole sequences: this module composes the very references the
models call (mHC, QKV RoPE, the compressor, the indexer's top-k, sparse and draft attention,
SwiGLU) on functional caches built from the whole sequence, so the numerics are the
reference's by construction (tests/models/test_train_model.py compares the two on the same
weights). Differences that are not numerics: every weight is an fp32 parameter (the stored
formats come back with `to_checkpoint`), the activations are fp32 with no FP8 simulation, and
the routed experts run only on the tokens routed to them.

`fake_quant=True` (quantization-aware training) makes every weight read its stored format on
the forward (FP8 block-scaled, MXFP4, bf16) with the straight-through gradient, so what
training optimises is the model the engine runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_compile.kernels.act_quant import swiglu
from dspark_compile.kernels.common import rmsnorm, rope_last
from dspark_compile.kernels.compress import compress_reference
from dspark_compile.kernels.draft_attention import context_slot_positions, draft_attention_reference
from dspark_compile.kernels.indexer_topk import indexer_topk_reference
from dspark_compile.kernels.mhc import hc_head_reference, hc_post_reference, hc_pre_reference
from dspark_compile.kernels.qkv_postprocess import qkv_rope_reference
from dspark_compile.kernels.sparse_attention import sparse_attention_reference
from dspark_compile.models.config import ModelConfig
from dspark_compile.models.quant_formats import (
    fp8_block_dequant, fp8_block_quant, mxfp4_dequant, mxfp4_quant)
from dspark_compile.models.rope import rope_table
from dspark_compile.models.schema import checkpoint_schema
from dspark_compile.models.weights import _EXPERT


def _key(name: str) -> str:
    return name.replace(".", "__")


class TrainParams(nn.Module):
    """Every float tensor of a checkpoint as an fp32 parameter under its checkpoint name, the
    routed experts stacked per layer (`<p>ffn.experts.w1` [E, I, D]); tid2eid as a buffer."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], fake_quant: bool = False):
        super().__init__()
        self.cfg, self.fake_quant = cfg, fake_quant
        self.schema = {n: s for n, s in checkpoint_schema(cfg).items() if n in tensors}
        self.params = nn.ParameterDict()
        self.ints: dict[str, torch.Tensor] = {}
        self.kind: dict[str, str] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for name, spec in self.schema.items():
            t = tensors[name]
            if spec.kind in ("fp8_scale", "mxfp4_scale"):
                continue
            base = name[: -len(".weight")] if name.endswith(".weight") else name
            if spec.kind == "tid2eid":
                self.ints[name] = t.clone()
            elif spec.kind == "fp8_weight":
                w = fp8_block_dequant(t, tensors[f"{base}.scale"], cfg.fp8_block)
                self._add(name, w, "fp8")
            elif spec.kind == "mxfp4_weight":
                m = _EXPERT.match(name)
                stack = f"{m.group(1)}.{m.group(3)}"
                experts.setdefault(stack, {})[int(m.group(2))] = mxfp4_dequant(
                    t, tensors[f"{base}.scale"])
            else:
                self._add(name, t.float(), "bf16" if spec.dtype == torch.bfloat16 else "f32")
        for stack, per in experts.items():
            self._add(stack, torch.stack([per[e] for e in range(len(per))]), "mxfp4")

    def _add(self, name: str, value: torch.Tensor, kind: str) -> None:
        self.params[_key(name)] = nn.Parameter(value.contiguous())
        self.kind[name] = kind

    def w(self, name: str) -> torch.Tensor:
        """The weight `name` as the forward reads it (its stored format under fake_quant)."""
        if name in self.ints:
            return self.ints[name]
        p = self.params[_key(name)]
        if not self.fake_quant or self.kind[name] == "f32":
            return p
        return p + (quantize_roundtrip(p.detach(), self.kind[name], self.cfg) - p.detach())

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.kind if n.startswith(prefix)]

    def group(self, prefix: str) -> list[nn.Parameter]:
        return [self.params[_key(n)] for n in self.names(prefix)]

    @torch.no_grad()
    def to_checkpoint(self) -> dict[str, torch.Tensor]:
        """The parameters in the checkpoint's stored formats, schema order."""
        out: dict[str, torch.Tensor] = {}
        for name, spec in self.schema.items():
            if name in out or spec.kind in ("fp8_scale", "mxfp4_scale"):
                continue
            if spec.kind == "tid2eid":
                out[name] = self.ints[name]
                continue
            base = name[: -len(".weight")] if name.endswith(".weight") else name
            if spec.kind == "fp8_weight":
                q, s = fp8_block_quant(self.params[_key(name)].detach(), self.cfg.fp8_block)
                out[name], out[f"{base}.scale"] = q, s
            elif spec.kind == "mxfp4_weight":
                m = _EXPERT.match(name)
                w = self.params[_key(f"{m.group(1)}.{m.group(3)}")].detach()[int(m.group(2))]
                out[name], out[f"{base}.scale"] = mxfp4_quant(w)
            else:
                out[name] = self.params[_key(name)].detach().to(spec.dtype).contiguous()
        return {n: out[n] for n in self.schema}


def quantize_roundtrip(w: torch.Tensor, kind: str, cfg: ModelConfig) -> torch.Tensor:
    """w through its stored format and back to fp32 (fp8 | mxfp4 | bf16)."""
    if kind == "fp8":
        return fp8_block_dequant(*fp8_block_quant(w, cfg.fp8_block), cfg.fp8_block)
    if kind == "mxfp4":
        return torch.stack([mxfp4_dequant(*mxfp4_quant(e)) for e in w])
    return w.to(torch.bfloat16).float()


# ---- shared pieces ----------------------------------------------------------------------------

class Rope:
    def __init__(self, cfg: ModelConfig, max_positions: int):
        self.main = rope_table(cfg.rope_main, cfg.qk_rope_head_dim, max_positions)
        self.comp = rope_table(cfg.rope_compress, cfg.qk_rope_head_dim, max_positions)


def _lin(P: TrainParams, name: str, x: torch.Tensor) -> torch.Tensor:
    return x @ P.w(f"{name}.weight").T


def _project_q_kv(P: TrainParams, p: str, x: torch.Tensor):
    cfg, eps = P.cfg, P.cfg.rms_norm_eps
    qr = rmsnorm(_lin(P, f"{p}wq_a", x), P.w(f"{p}q_norm.weight"), eps)
    kv = rmsnorm(_lin(P, f"{p}wkv", x), P.w(f"{p}kv_norm.weight"), eps)
    q = _lin(P, f"{p}wq_b", qr).view(-1, cfg.num_attention_heads, cfg.head_dim)
    return q, qr, kv


def _output(P: TrainParams, p: str, o: torch.Tensor, pos: torch.Tensor, cos_sin) -> torch.Tensor:
    """o [M, H, d] -> inverse RoPE -> grouped wo_a (group g: its heads x wo_a rows of g) -> wo_b."""
    cfg = P.cfg
    o = rope_last(o, cos_sin, pos, cfg.qk_rope_head_dim, inverse=True)
    G = cfg.o_groups
    wa = P.w(f"{p}wo_a.weight")
    z = torch.einsum("mgk,gnk->mgn", o.reshape(o.shape[0], G, -1), wa.view(G, -1, wa.shape[1]))
    return _lin(P, f"{p}wo_b", z.reshape(o.shape[0], -1))


def _block(P: TrainParams, p: str, X: torch.Tensor, tokens: torch.Tensor, attn) -> torch.Tensor:
    cfg = P.cfg
    hc = (cfg.hc_eps, cfg.rms_norm_eps, cfg.hc_sinkhorn_iters)
    a, post, comb = hc_pre_reference(X, P.w(f"{p}hc_attn_fn"), P.w(f"{p}hc_attn_scale"),
                                     P.w(f"{p}hc_attn_base"), *hc)
    X = hc_post_reference(attn(rmsnorm(a, P.w(f"{p}attn_norm.weight"), cfg.rms_norm_eps)),
                          X, post, comb)
    f, post, comb = hc_pre_reference(X, P.w(f"{p}hc_ffn_fn"), P.w(f"{p}hc_ffn_scale"),
                                     P.w(f"{p}hc_ffn_base"), *hc)
    y = _moe(P, f"{p}ffn.", rmsnorm(f, P.w(f"{p}ffn_norm.weight"), cfg.rms_norm_eps), tokens)
    return hc_post_reference(y, X, post, comb)


def _moe(P: TrainParams, p: str, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """models/moe.py's router, then each routed expert on its own tokens (index_add in token
    order: deterministic), plus the shared expert."""
    cfg = P.cfg
    score = torch.sqrt(F.softplus(_lin(P, f"{p}gate", x)))
    tid = f"{p}gate.tid2eid"
    if tid in P.ints:
        idx = P.ints[tid][tokens]
    else:
        idx = (score + P.w(f"{p}gate.bias")).topk(cfg.num_experts_per_tok, dim=-1).indices
    w = score.gather(-1, idx)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
    w = w * cfg.routed_scaling_factor
    w1, w3, w2 = (P.w(f"{p}experts.{n}") for n in ("w1", "w3", "w2"))
    y = torch.zeros_like(x)
    for e in range(cfg.n_routed_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = swiglu(xe @ w1[e].T, xe @ w3[e].T, cfg.swiglu_limit)
        y = y.index_add(0, tok, (h @ w2[e].T) * w[tok, slot, None])
    s = f"{p}shared_experts."
    h = swiglu(_lin(P, f"{s}w1", x), _lin(P, f"{s}w3", x), cfg.swiglu_limit)
    return y + _lin(P, f"{s}w2", h)


def _logits(P: TrainParams, X: torch.Tensor, p: str) -> torch.Tensor:
    cfg = P.cfg
    h = hc_head_reference(X, P.w(f"{p}hc_head_fn"), P.w(f"{p}hc_head_scale"),
                          P.w(f"{p}hc_head_base"), cfg.hc_eps, cfg.rms_norm_eps)
    return rmsnorm(h, P.w(f"{p}norm.weight"), cfg.rms_norm_eps) @ P.w("head.weight").T


def _streams(P: TrainParams, tokens: torch.Tensor) -> torch.Tensor:
    e = P.w("embed.weight")[tokens.reshape(-1)]
    return e.unsqueeze(1).expand(-1, P.cfg.hc_mult, -1)


# ---- target -----------------------------------------------------------------------------------

def _compress(P: TrainParams, p: str, ratio: int, x: torch.Tensor, pos: torch.Tensor, cos_sin):
    """Every block's compressed entry of the whole sequence: [B, ceil(T / ratio), d_c].

    The references' ring is the sequence itself (ring = T: slot t holds position t)."""
    B, T = pos.shape
    k, s = _lin(P, f"{p}wkv", x), _lin(P, f"{p}wgate", x)
    ring_kv = x.new_zeros(B, T, k.shape[-1])
    ring_score = x.new_zeros(B, T, k.shape[-1])
    rows = torch.arange(B)
    slots = torch.arange(B * T)
    return compress_reference(k, s, P.w(f"{p}ape"), pos, rows, torch.ones(B, dtype=torch.bool),
                              slots, ring_kv, ring_score, P.w(f"{p}norm.weight"), cos_sin,
                              P.cfg.rms_norm_eps, x.dtype)


def _target_attention(P: TrainParams, layer: int, x: torch.Tensor, pos: torch.Tensor, rope: Rope):
    cfg = P.cfg
    p = f"layers.{layer}.attn."
    ratio = cfg.compress_ratios[layer]
    cos_sin = rope.comp if ratio else rope.main
    B, T = pos.shape
    flat = pos.reshape(-1)
    q, qr, kv = _project_q_kv(P, p, x)
    q, kv = qkv_rope_reference(q, kv, flat, cos_sin, cfg.rms_norm_eps)
    rows = torch.arange(B)
    cmp, top_idx = (None, None, None), None
    if ratio == 4:
        ip = f"{p}indexer."
        keys = _compress(P, f"{ip}compressor.", 4, x, pos, cos_sin)
        qi = _lin(P, f"{ip}wq_b", qr).view(B * T, cfg.index_n_heads, cfg.index_head_dim)
        qi = rope_last(qi, cos_sin, flat, cos_sin.shape[-1]).view(B, T, cfg.index_n_heads, -1)
        wi = _lin(P, f"{ip}weights_proj", x) * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)
        top_idx = indexer_topk_reference(qi, wi.view(B, T, -1), keys, rows, pos, cfg.index_topk, 4)
    if ratio:
        cmp = (_compress(P, f"{p}compressor.", ratio, x, pos, cos_sin), None, None)
    o = sparse_attention_reference(q.view(B, T, cfg.num_attention_heads, -1), kv.view(B, T, -1),
                                   None, None, *cmp, top_idx, rows, pos, P.w(f"{p}attn_sink"),
                                   cfg.head_dim ** -0.5, cfg.sliding_window, ratio)
    return _output(P, p, o.reshape(B * T, cfg.num_attention_heads, -1), flat, cos_sin)


def target_forward(P: TrainParams, tokens: torch.Tensor, rope: Rope, aux: bool = False):
    """tokens [B, T] at positions 0..T-1 -> logits [B, T, V] (and, with `aux`, the hc-mean of
    the streams after each dspark_target_layer_ids layer, concatenated: [B, T, nL * D])."""
    cfg = P.cfg
    B, T = tokens.shape
    pos = torch.arange(T).expand(B, T)
    flat_tok = tokens.reshape(-1)
    X = _streams(P, tokens)
    hidden = []
    for i in range(cfg.num_hidden_layers):
        X = _block(P, f"layers.{i}.", X, flat_tok,
                   lambda x, i=i: _target_attention(P, i, x, pos, rope))
        if aux and i in cfg.dspark_target_layer_ids:
            hidden.append(X.mean(1))
    logits = _logits(P, X, "").view(B, T, -1)
    return (logits, torch.cat(hidden, -1).view(B, T, -1)) if aux else logits


# ---- draft ------------------------------------------------------------------------------------

def draft_forward(P: TrainParams, aux: torch.Tensor, anchors: torch.Tensor, last: torch.Tensor,
                  prev: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Draft logits (base + Markov bias) of blocks drafted after committed positions `last`.

    aux [B, T, nL*D] target hidden states of a sequence; anchors, last [B, A]: block a of row b
    drafts after position last[b, a] from anchor token anchors[b, a] (at last + 1); prev
    [B, A, N]: the token before each draft position (the anchor, then the drafts the target
    would accept). Returns [B, A, N, V]: draft k of each block predicts position last + 2 + k.
    """
    cfg = P.cfg
    N, W, H = cfg.dspark_block_size, cfg.sliding_window, cfg.num_attention_heads
    B, A = anchors.shape
    eps = cfg.rms_norm_eps
    main_x = rmsnorm(_lin(P, "mtp.0.main_proj", aux), P.w("mtp.0.main_norm.weight"), eps)
    T = aux.shape[1]
    pos_ctx = torch.arange(T).expand(B, T).reshape(-1)
    flat_last = last.reshape(-1)
    # ring slot s of block (b, a) holds position L - ((L - s) mod W), L = last[b, a]
    ring_pos = context_slot_positions(flat_last, W)                     # [B*A, W]
    ring_src = (torch.arange(B).repeat_interleave(A)[:, None] * T + ring_pos.clamp_min(0))
    ids = torch.cat((anchors.reshape(-1, 1),
                     torch.full((B * A, N - 1), cfg.dspark_noise_token_id)), 1)
    qpos = flat_last[:, None] + 1 + torch.arange(N)                     # [B*A, N]
    rows = torch.arange(B * A)
    flat_ids, flat_qpos = ids.reshape(-1), qpos.reshape(-1)
    X = _streams(P, ids)
    for i in range(cfg.n_mtp_layers):
        p = f"mtp.{i}."
        ctx = rmsnorm(_lin(P, f"{p}attn.wkv", main_x.reshape(B * T, -1)),
                      P.w(f"{p}attn.kv_norm.weight"), eps)
        ctx = rope_last(ctx, rope.main, pos_ctx, cfg.qk_rope_head_dim)
        ring = ctx[ring_src]                                            # [B*A, W, d]

        def attn(x, p=p, ring=ring):
            q, _, kv = _project_q_kv(P, f"{p}attn.", x)
            q, kv = qkv_rope_reference(q, kv, flat_qpos, rope.main, eps)
            o = draft_attention_reference(q.view(B * A, N, H, -1), kv.view(B * A, N, -1), ring,
                                          rows, flat_last, P.w(f"{p}attn.attn_sink"),
                                          cfg.head_dim ** -0.5)
            return _output(P, f"{p}attn.", o.reshape(B * A * N, H, -1), flat_qpos, rope.main)

        X = _block(P, p, X, flat_ids, attn)
    lastp = f"mtp.{cfg.n_mtp_layers - 1}."
    base = _logits(P, X, lastp).view(B, A, N, -1)
    w1 = P.w(f"{lastp}markov_head.markov_w1.weight")
    w2 = P.w(f"{lastp}markov_head.markov_w2.weight")
    return base + w1[prev] @ w2.T
