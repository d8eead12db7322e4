"""The lossless checks: greedy speculative output vs greedy decoding of the target alone.

    compare_outputs(target, speculative)   the engine's own target-only decoding against its
                                           speculative decoding: equal token for token, or the
                                           first divergence (`run --check-lossless`, "lossless:")
    check_lossless(model, ..., outputs)    outputs against the eager reference's target greedy
                                           decoding, with the logit margin at a divergence
                                           ("reference:"; REFERENCE_TOLERANCE says when a
                                           divergence is rounding, not a bug)

The reference decodes each request with the target alone under the request's own stop ids and
max_new_tokens, so an output that ends too early or runs past a stop id is a divergence too,
not only a differing token. On a mismatch the report names the first diverging position and
the target's logit margin there (logit[expected] minus logit[engine's token], top-1 minus
top-2, and the top-1 logit itself as the scale), so a flip caused by a near-tie in low precision
is told apart from a real bug.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from dspark_compile.models.config import CacheConfig, request_positions
from dspark_compile.models.generate import set_row_sampling
from dspark_compile.models.request import SamplingParams
from dspark_compile.models.state import allocate_state
from dspark_compile.models.step import prefill, target_decode_step

END = -1   # `expected`/`got` value meaning "the output ended here"


def reference_tolerance(prec) -> float:
    """The relative logit margin (|margin| / |top-1 logit|) up to which a token where the engine
    and the eager reference differ is a near-tie flipped by rounding, not a bug: one rounding
    step of the coarsest format on the path, 2^-4 for FP8 e4m3 (3 mantissa bits; activation and
    KV quant), else 64 ulps of the compute dtype (reduction order over K)."""
    if getattr(prec, "act_quant", False) or getattr(prec, "kv_fp8", False):
        return 2.0 ** -4
    return 64 * torch.finfo(prec.dtype).eps


@dataclass
class LosslessReport:
    ok: bool
    request: int = -1
    index: int = -1
    expected: int = -1         # target greedy token there (END: the reference had ended)
    got: int = -1              # the engine's token there (END: the engine's output had ended)
    margin: float = 0.0        # logit[expected] - logit[got] at the divergence (tokens only)
    top2_gap: float = 0.0      # top-1 minus top-2 logit there
    top1: float = 0.0          # the top-1 logit there (scale for a relative margin)
    label: str = "lossless"
    expected_name: str = "target greedy"
    got_name: str = "engine"
    logits: bool = True        # margin / top2_gap / top1 hold the reference's logits there

    @property
    def relative_margin(self) -> float:
        """|margin| relative to the top-1 logit's magnitude (inf when a length differs)."""
        if self.ok:
            return 0.0
        if END in (self.expected, self.got):
            return float("inf")
        return abs(self.margin) / max(abs(self.top1), 1e-12)

    def line(self, tolerance: float | None = None) -> str:
        """One line; with `tolerance` (reference_tolerance), a token divergence says whether
        its relative margin is within it."""
        if self.ok:
            return f"{self.label}: ok"
        where = f"{self.label}: DIVERGED at request {self.request}, token {self.index}: "
        exp, got = self.expected_name, self.got_name
        if self.got == END:
            return where + f"the {got} output ended; {exp} continues with {self.expected}"
        if self.expected == END:
            return where + (f"{exp} ends there (stop id or max tokens); the {got} output "
                            f"continued with {self.got}")
        if not self.logits:
            return where + f"{exp} {self.expected}, {got} {self.got}"
        line = where + (f"{exp} {self.expected}, {got} {self.got}; logit margin "
                        f"{self.margin:.3e} (top-1 minus top-2 {self.top2_gap:.3e}, top-1 "
                        f"{self.top1:.3e}, relative {self.relative_margin:.2e})")
        if tolerance is not None:
            verdict = "within" if self.within(tolerance) else "BEYOND"
            line += f", {verdict} the tolerance {tolerance:.2e}"
        return line

    def within(self, tolerance: float) -> bool:
        """Equal outputs, or a first divergence at a near-tie (relative margin <= tolerance)."""
        return self.ok or (self.logits and self.relative_margin <= tolerance)


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int, device="cpu", stop_ids=()):
    """Plain target greedy decoding of up to `n` tokens (ending after the first stop id);
    returns (tokens, logits per token)."""

    cache = CacheConfig(max_rows=1, max_seq_len=request_positions(len(prompt), n, 0),
                        max_step_tokens=64)
    state = allocate_state(model.cfg, cache, model.prec, device)
    set_row_sampling(state, 0, SamplingParams())
    tok, logits = prefill(model, state, 0, prompt, cache.max_step_tokens, speculative=False,
                          return_logits=True)
    tokens, all_logits = [tok], [logits]
    rows = torch.tensor([0], device=device)
    while len(tokens) < n and tokens[-1] not in stop_ids:
        last = torch.tensor([tokens[-1]], device=device)
        nxt, logits = target_decode_step(model, state, rows, last)
        tokens.append(int(nxt[0]))
        all_logits.append(logits[0])
    return tokens, all_logits


def compare_outputs(expected, outputs, label: str = "lossless",
                    expected_name: str = "target-only decoding",
                    got_name: str = "speculative") -> LosslessReport:
    """Each request's `outputs` against `expected` (the engine's target-only decoding of the
    same requests), token for token: the first divergence (a differing token, or one output
    ending before the other), or ok."""
    if len(expected) != len(outputs):
        raise ValueError(f"{len(expected)} expected outputs and {len(outputs)} outputs: one of "
                         "each per request")
    for i, (ref, got) in enumerate(zip(expected, outputs)):
        ref, got = list(ref), list(got)
        for j in range(max(len(ref), len(got))):
            a = ref[j] if j < len(ref) else END
            b = got[j] if j < len(got) else END
            if a != b:
                return LosslessReport(False, i, j, a, b, label=label, logits=False,
                                      expected_name=expected_name, got_name=got_name)
    return LosslessReport(True, label=label)


def check_lossless(model, prompts, params, outputs, device="cpu",
                   label: str = "lossless") -> LosslessReport:
    """Compare each request's output with target-only greedy decoding under its own
    SamplingParams (stop ids, max_new_tokens); returns the first divergence (or ok).

    Greedy only: a request with temperature > 0 has no single right answer to compare with."""
    if not len(prompts) == len(params) == len(outputs):
        raise ValueError(f"{len(prompts)} prompts, {len(params)} sampling params and "
                         f"{len(outputs)} outputs: one of each per request")
    for i, sp in enumerate(params):
        if sp.method != "greedy":      # below GREEDY_BELOW a temperature is greedy too
            raise ValueError(f"request {i}: temperature {sp.temperature} samples; the lossless "
                             "check compares greedy decoding only")
    for i, (prompt, sp, got) in enumerate(zip(prompts, params, outputs)):
        got = list(got)
        ref, logits = greedy_reference(model, prompt, sp.max_new_tokens, device, tuple(sp.stop_ids))
        for j in range(max(len(ref), len(got))):
            a = ref[j] if j < len(ref) else END
            b = got[j] if j < len(got) else END
            if a == b:
                continue
            if END in (a, b):
                return LosslessReport(False, i, j, a, b, label=label)
            lg = logits[j].double()
            top2 = lg.topk(2).values
            if not 0 <= b < lg.numel():
                return LosslessReport(False, i, j, a, b, float("inf"), float(top2[0] - top2[1]),
                                      float(top2[0]), label=label)
            return LosslessReport(False, i, j, a, b, float(lg[a] - lg[b]),
                                  float(top2[0] - top2[1]), float(top2[0]), label=label)
    return LosslessReport(True, label=label)
