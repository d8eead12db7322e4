"""A deeper model's step predicted from a measured one, per layer type (issue 55 item 4).

The measured step (benchmarks/step.py on a preset with one layer of each type: flash-slice's
SWA hash-routed, C4 and C128 layers and 3 draft layers) gives, per part (step_launches.per_layer
on the engine's program, uncaptured): its kernels' device µs and launches; step_roofline gives
each part's floor (its bytes at the copy bandwidth, plus the FLOP time of its FLOP-bound ops
over their bytes). A layer's type is `layer_type`: swa / c4 / c128 (+ `-hash` for the first
num_hash_layers), `draft` for a draft stage; head, samplers, embedding and what the profiler
attributes to no layer are the step's fixed part.

The prediction for a target config (Flash-0731: 2 SWA + 1 C4 hash-routed, then 20 C128 and 20
C4 bias-routed, 3 draft stages):

    kernels = sum over its layers of the measured per-layer µs of that type + fixed
    gaps    = (replay µs - the replay's kernel µs) / the replay's launches  x  predicted launches
    step    = kernels + gaps
    floor   = sum over its layers of the type's per-layer floor + fixed floor

A type the measured preset does not have is taken from the same ratio without the hash
(`c4-hash` from `c4`): named in `fallbacks`. Per bucket, tokens/s = B x accepted length / step
for each --accepted-lengths value. The form is checked on a real deep program by predicting the
tiny-deep preset from tiny and measuring tiny-deep in the same run.
"""
from __future__ import annotations

from step_roofline import bytes_by_part, layer_type

PREDICT_FOR = {"flash-slice": "flash-0731", "tiny": "tiny-deep"}


def part_floors(floor: dict, model, bw: float) -> dict:
    """Floor µs per part: its share of the byte floor plus its FLOP excess; the head's second
    read goes to the head."""
    honest = floor.get("honest", {})
    out = {p: b / bw * 1e6 for p, b in bytes_by_part(floor, model).items()}
    for p, c in honest.get("op_parts", {}).items():
        out[p] = out.get(p, 0.0) + c["flop_excess_us"]
    out["head"] = out.get("head", 0.0) + honest.get("head_second_read_us", 0.0)
    return out


def _by_type(cfg, values: dict) -> tuple[dict, dict]:
    """(mean per layer type, sum over non-layer parts) of a part -> number map."""
    types: dict = {}
    fixed = 0.0
    for part, v in values.items():
        t = layer_type(cfg, part)
        if t == part:
            fixed += v
        else:
            types.setdefault(t, []).append(v)
    return {t: sum(v) / len(v) for t, v in types.items()}, fixed


def composition(cfg) -> list[str]:
    """The layer types of a config's target layers then its draft stages."""
    return ([layer_type(cfg, f"layers.{i}") for i in range(cfg.num_hidden_layers)]
            + ["draft"] * cfg.n_mtp_layers)


def _lookup(per_type: dict, t: str, fallbacks: set) -> float:
    if t in per_type:
        return per_type[t]
    alt = t[:-len("-hash")] if t.endswith("-hash") else t + "-hash"
    if alt in per_type:
        fallbacks.add(f"{t} <- {alt}")
        return per_type[alt]
    raise KeyError(f"layer type {t} not measured (measured: {', '.join(sorted(per_type))})")


def predict(measured_cfg, target_cfg, layers: dict, row: dict, replay_kernel_us: float,
            floors: dict, B: int, accepted_lengths: list[float]) -> dict:
    """`layers`: per_layer's engine dict (part -> {"us", "total", ...}); `row`: the engine
    variant's step.py row (us_median, launches_total); `replay_kernel_us`: the replay's kernels
    summed; `floors`: part_floors. Returns the prediction and its parts."""
    us = {p: d["us"] for p, d in layers.items() if isinstance(d, dict) and "us" in d}
    launches = {p: d.get("total", 0) for p, d in layers.items() if isinstance(d, dict)}
    t_us, fixed_us = _by_type(measured_cfg, us)
    t_launch, fixed_launch = _by_type(measured_cfg, launches)
    t_floor, fixed_floor = _by_type(measured_cfg, floors)
    comp = composition(target_cfg)
    fb: set = set()
    kernels = fixed_us + sum(_lookup(t_us, t, fb) for t in comp)
    n_launch = fixed_launch + sum(_lookup(t_launch, t, fb) for t in comp)
    floor = fixed_floor + sum(_lookup(t_floor, t, fb) for t in comp)
    gap = max(0.0, row["us_median"] - replay_kernel_us) / max(row["launches_total"], 1)
    step = kernels + gap * n_launch
    counts = {t: comp.count(t) for t in sorted(set(comp))}
    return {"target_layers": counts, "per_type_us": t_us, "per_type_launches": t_launch,
            "per_type_floor_us": t_floor, "fixed_us": fixed_us, "fixed_launches": fixed_launch,
            "fixed_floor_us": fixed_floor, "gap_us_per_launch": gap,
            "kernel_us": kernels, "launches": n_launch, "step_us": step, "floor_us": floor,
            "ratio_to_floor": step / floor if floor else None, "fallbacks": sorted(fb),
            "tokens_per_s": {str(a): B * a / step * 1e6 for a in accepted_lengths}}
