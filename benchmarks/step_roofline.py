"""The honest floor of one step (issue 55 item 1): the byte floor (step_floor.py) with the LM head
counted twice, and every matmul-like op's floor raised to its FLOP time where that is longer.

Two corrections to the byte floor, each its own number in the result:

- **The LM head read twice.** The verify logits need the head; the draft's base logits need it
  again, after verification (the draft's anchor is the token verification accepted), so no
  schedule reads it once. The byte floor counts each weight once: this adds the head's bytes.
- **FLOP-bound ops.** One eager run of the reference step under a dispatch mode (`OpLedger`)
  records every matmul-like op it calls -- `dspark::fp8_linear`, `dspark::linear`,
  `dspark::moe_experts`, `dspark::sparse_attention`, `dspark::draft_attention`, aten `mm` /
  `bmm` -- with its FLOPs, the bytes of model weights it reads (the routed experts' share for
  the MoE: the experts its tokens route to) and the bytes of decode state it reads (the byte
  floor's per-tensor count for the caches it attends over), attributed to the layer it runs in
  (`layers.N`, `mtp.N`; `head` for an op reading the LM head; `other`). Its floor is
  max(bytes / copy bandwidth, FLOPs / peak MMA rate of its operand dtype); where the FLOP time
  is the larger, the difference is added to the floor (`flop_excess_us`).

  Peak MMA rates are the datasheet's dense rates of the device (`PEAK_TFLOPS`; `--mma-tflops`
  for another device): what the issue's targets are stated against. An op's MMA dtype: FP8
  for `fp8_linear` fed FP8 activations (its x_s present), the activation dtype otherwise
  (bf16 in deployment; fp32 / fp64 runs have no MMA peak: the correction is then off, said in
  the result).

    honest_us = byte floor us + head bytes / bw + sum over ops of max(0, flop_us - byte_us)

Per part (`parts`): the same sums for each layer, the head and the rest, with the byte floor's
weights and state split the same way, for the per-layer-type prediction (step_predict.py).
"""
from __future__ import annotations

import re
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Datasheet dense tensor-core rates (TFLOP/s, no sparsity) by a device-name substring: the SXM
# H100 and the H200 share the H100's tensor cores (989.4 bf16, 1978.9 fp8); the PCIe H100 runs
# them at a lower clock (756 / 1513).
PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "fp8": 1513.0}),
    ("H100", {"bf16": 989.4, "fp8": 1978.9}),
    ("H200", {"bf16": 989.4, "fp8": 1978.9}),
)

_PART = re.compile(r"^(layers|mtp)\.(\d+)")


def peak_tflops(device_name: str | None, override: dict | None = None) -> dict | None:
    """{"bf16": T, "fp8": T} for the device (`override` first), None when unknown."""
    if override:
        return dict(override)
    for key, rates in PEAK_TFLOPS:
        if device_name and key in device_name:
            return dict(rates)
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class OpLedger(TorchDispatchMode):
    """Records every matmul-like op of one eager step: part, op, FLOPs, weight bytes, state
    bytes, MMA dtype. Install with `ledger(model, state, state_read)`."""

    def __init__(self, weights: dict, experts: dict, state_ptrs: dict, state_read: dict,
                 head_ptr: int, cfg):
        super().__init__()
        self.weights, self.experts, self.cfg = weights, experts, cfg
        self.state_ptrs, self.state_read, self.head_ptr = state_ptrs, state_read, head_ptr
        self.part = "other"
        self.ops: list[dict] = []

    # -- what an op reads
    def _weight_bytes(self, tensors) -> tuple[int, bool]:
        b, head, seen = 0, False, set()
        for t in tensors:
            p = t.untyped_storage().data_ptr() if t.numel() else 0
            if p in self.weights and p not in seen:
                seen.add(p)
                b += self.weights[p]
                head |= p == self.head_ptr
        return b, head

    def _state_bytes(self, tensors) -> int:
        seen = set()
        for t in tensors:
            name = self.state_ptrs.get(t.untyped_storage().data_ptr() if t.numel() else 0)
            if name is not None:
                seen.add(name)
        return sum(self.state_read.get(n, 0) for n in seen)

    def _flops(self, name: str, args) -> tuple[int, str] | None:
        """(FLOPs, MMA dtype key) of a matmul-like op; None for any other op."""
        def mma(x):
            return {torch.bfloat16: "bf16", torch.float16: "bf16"}.get(x.dtype, str(x.dtype))
        if name in ("dspark.fp8_linear", "dspark.linear"):
            x, w = args[0], args[2] if name == "dspark.fp8_linear" else args[1]
            m = x.numel() // x.shape[-1]
            fp8 = name == "dspark.fp8_linear" and args[1] is not None
            return 2 * m * w.shape[0] * w.shape[1], "fp8" if fp8 else mma(x)
        if name == "dspark.moe_experts":
            x, ids = args[0], args[1]
            pairs = ids.numel()       # (token, expert) pairs, padded rows included
            return 2 * pairs * 3 * self.cfg.hidden_size * self.cfg.moe_intermediate_size, mma(x)
        if name == "dspark.sparse_attention":
            q, cmp_kv, cmp_idx, pos = args[0], args[4], args[7], args[9]
            window, ratio = int(args[12]), int(args[13])
            H, d = q.shape[-2], q.shape[-1]        # q [B, T, H, d], pos [B, T]
            p = pos.reshape(-1).to(torch.int64).cpu()
            cand = torch.clamp(p + 1, max=window)
            if cmp_idx is not None:
                cand = cand + cmp_idx.shape[-1]
            elif cmp_kv is not None and ratio > 0:
                cand = cand + torch.div(p + 1, ratio, rounding_mode="floor")
            return 4 * H * d * int(cand.sum()), mma(q)
        if name == "dspark.draft_attention":
            q, ring = args[0], args[2]
            B, N, H, d = q.shape
            return 4 * B * N * H * d * (ring.shape[1] + N), mma(q)
        if name == "aten.mm":
            a, b = args[0], args[1]
            return 2 * a.shape[0] * a.shape[1] * b.shape[1], mma(a)
        if name == "aten.bmm":
            a, b = args[0], args[1]
            return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2], mma(a)
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func.namespace}.{func.overloadpacket.__name__}"
        got = self._flops(name, args) if name.startswith(("dspark.", "aten.mm", "aten.bmm")) else None
        if got is not None:
            flat = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            wb, head = self._weight_bytes(flat)
            if name == "dspark.moe_experts":
                wb = self.experts.get(self.part, wb)
            self.ops.append({"part": "head" if head else self.part, "op": name, "flops": got[0],
                             "mma": got[1], "weight_bytes": wb,
                             "state_bytes": self._state_bytes(flat)})
        return func(*args, **kwargs)


@contextmanager
def ledger(model, state: dict, floor: dict):
    """An OpLedger over one eager step of `model` on `state`; `floor`: step_floor.byte_floor's
    result for the same rows and routing (its per-tensor state reads and experts used)."""
    weights = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.numel():
            weights.setdefault(t.untyped_storage().data_ptr(), _nbytes(t))
    # the MoE op's weights: only the experts its tokens route to (the byte floor's count)
    experts = {}
    E = model.cfg.n_routed_experts
    per_moe = floor.get("experts_used_per_moe", {})
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        moe, _, leaf = name.rpartition(".experts.")
        if leaf and moe in per_moe:
            part = _PART.match(name)
            key = part.group(0) if part else "other"
            experts[key] = experts.get(key, 0) + _nbytes(t) * per_moe[moe] // E
    state_ptrs = {t.untyped_storage().data_ptr(): n for n, t in state.items() if t.numel()}
    state_read = {n: v["read"] for n, v in floor.get("state_per_tensor", {}).items()}
    led = OpLedger(weights, experts, state_ptrs, state_read,
                   model.head.weight.untyped_storage().data_ptr(), model.cfg)
    handles = []
    for prefix in ("layers", "mtp"):
        mods = getattr(model, prefix, None) or []
        for i, mod in enumerate(mods):
            def pre(m, a, label=f"{prefix}.{i}"):
                led.part = label

            def post(m, a, o):
                led.part = "other"
            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        with led:
            yield led
    finally:
        for h in handles:
            h.remove()


def part_of(name: str) -> str:
    m = _PART.match(name)
    return m.group(0) if m else ("head" if name == "head.weight" else "other")


def honest_floor(floor: dict, ops: list[dict], head_bytes: int, bw: float,
                 peak: dict | None) -> dict:
    """The honest floor from the byte floor (`floor`, with "bytes"), the ledger's ops, the LM
    head's bytes, the copy bandwidth (bytes/s) and the peak MMA rates (TFLOP/s by dtype key;
    None: no FLOP correction). Per op class and per part: FLOPs, bytes, byte / FLOP µs."""
    byte_us = floor["bytes"] / bw * 1e6
    head_us = head_bytes / bw * 1e6
    classes: dict = {}
    parts: dict = {}
    excess = 0.0
    unknown = set()
    for op in ops:
        b = op["weight_bytes"] + op["state_bytes"]
        rate = (peak or {}).get(op["mma"])
        op_byte_us = b / bw * 1e6
        op_flop_us = op["flops"] / (rate * 1e12) * 1e6 if rate else None
        if rate is None:
            unknown.add(op["mma"])
        ex = max(0.0, op_flop_us - op_byte_us) if op_flop_us is not None else 0.0
        excess += ex
        for table, key in ((classes, op["op"]), (parts, op["part"])):
            c = table.setdefault(key, {"calls": 0, "flops": 0, "bytes": 0, "byte_us": 0.0,
                                       "flop_us": 0.0, "flop_excess_us": 0.0})
            c["calls"] += 1
            c["flops"] += op["flops"]
            c["bytes"] += b
            c["byte_us"] += op_byte_us
            c["flop_us"] += op_flop_us or 0.0
            c["flop_excess_us"] += ex
    return {"byte_floor_us": byte_us, "head_second_read_us": head_us,
            "flop_excess_us": excess, "honest_us": byte_us + head_us + excess,
            "peak_tflops": peak, "no_peak_for": sorted(unknown),
            "op_classes": classes, "op_parts": parts}


# A replay's kernels by op class (the first pattern a kernel name matches), and the ledger's ops
# whose floors a class's floor sums: the GEMM classes, whose ledger entries carry every byte and
# FLOP they must move. The others have no floor yet (share only): the ledger counts attention's
# FLOPs and state reads but not its activations, so its "floor" read 450x at B = 1.
KERNEL_CLASSES = (
    ("linear", r"^_linear_kernel$|^_splitk_sum_kernel$"),
    ("moe", r"^_moe_"),
    ("fp8_linear", r"^_fp8_linear"),
    ("samplers", r"markov|^row_|rows_stats|resample|accept|bound_walk|block_sums|rejection"),
    ("attention", r"attention|^_combine_kernel$|index_scores|topk_select|compress|context_kv|"
                  r"ring_slots"),
    ("mhc", r"^_hc_"),
    ("norm/quant/rope", r"rmsnorm|act_quant|swiglu|rope|qkv"),
    ("aten", r"at::|^void |cutlass|cublas|^sm\d+_xmma"),
)
CLASS_OPS = {"linear": ("dspark.linear",), "moe": ("dspark.moe_experts",),
             "fp8_linear": ("dspark.fp8_linear",)}


def kernel_class(name: str) -> str:
    return next((c for c, pat in KERNEL_CLASSES if re.search(pat, name)), "other")


def op_class_table(kernel_us: dict, step_us: float | None, op_classes: dict) -> list[dict]:
    """Per op class of one replay, largest first: device µs summed over its kernels, its share
    of the step, and its floor (the max of bytes and FLOP time of the ledger's ops of that
    class, honest_floor's op_classes) with the ratio, where the ledger has the class."""
    us: dict = {}
    for name, t in kernel_us.items():
        c = kernel_class(name)
        us[c] = us.get(c, 0.0) + t
    rows = []
    for c, t in sorted(us.items(), key=lambda kv: -kv[1]):
        ops = [op_classes[o] for o in CLASS_OPS.get(c, ()) if o in op_classes]
        floor = sum(max(o["byte_us"], o["flop_us"]) for o in ops) if ops else None
        rows.append({"class": c, "us": round(t, 2),
                     "share": round(t / step_us, 4) if step_us else None,
                     "floor_us": round(floor, 2) if floor else None,
                     "ratio": round(t / floor, 3) if floor else None})
    return rows


def bytes_by_part(floor: dict, model) -> dict:
    """The byte floor split by part (layers.N, mtp.N, head, other): weights (experts at their
    routed share) and decode state read + written; the logits written go to `head`."""
    E = model.cfg.n_routed_experts
    per_moe = floor.get("experts_used_per_moe", {})
    out: dict = {}
    seen = set()
    persistent = set(model.state_dict())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.numel():
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        moe, _, leaf = name.rpartition(".experts.")
        b = _nbytes(t) * per_moe[moe] // E if leaf and moe in per_moe else _nbytes(t)
        if (name == "embed.weight" or name not in persistent or name.endswith(".gate.tid2eid")
                or name.endswith("markov_w1.weight")):
            continue      # gathered rows (step_floor: a few rows each) stay in "other" below
        p = part_of(name)
        out[p] = out.get(p, 0) + b
    for name, rw in floor.get("state_per_tensor", {}).items():
        p = part_of(name)
        out[p] = out.get(p, 0) + rw["read"] + rw["written"]
    out["head"] = out.get("head", 0) + floor.get("logits_written_bytes", 0)
    out["other"] = out.get("other", 0) + max(0, floor["bytes"] - sum(out.values()))
    return out


def layer_type(cfg, part: str) -> str:
    """`swa`, `c4`, `c128` (with `-hash` for a hash-routed layer) for layers.N; `draft` for
    mtp.N; the part itself otherwise."""
    m = _PART.match(part)
    if not m:
        return part
    if m.group(1) == "mtp":
        return "draft"
    i = int(m.group(2))
    r = cfg.compress_ratios[i]
    kind = "swa" if r == 0 else f"c{r}"
    return kind + ("-hash" if i < cfg.num_hash_layers else "")

