"""The lossless check: greedy speculative output vs greedy decoding of the target alone.

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

END = -1   # `expected`/`got` value meaning "the output ended here"


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

    @property
    def relative_margin(self) -> float:
        """|margin| relative to the top-1 logit's magnitude (inf when a length differs)."""
        if self.ok:
            return 0.0
        if END in (self.expected, self.got):
            return float("inf")
        return abs(self.margin) / max(abs(self.top1), 1e-12)

    def line(self) -> str:
        if self.ok:
            return "lossless: ok"
        where = f"lossless: DIVERGED at request {self.request}, token {self.index}: "
        if self.got == END:
            return where + ("the engine's output ended; target greedy continues with "
                            f"{self.expected}")
        if self.expected == END:
            return where + (f"target greedy ends there (stop id or max tokens); the engine "
                            f"continued with {self.got}")
        return where + (f"target greedy {self.expected}, engine {self.got}; logit margin "
                        f"{self.margin:.3e} (top-1 minus top-2 {self.top2_gap:.3e}, top-1 "
                        f"{self.top1:.3e}, relative {self.relative_margin:.2e})")


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int, device="cpu", stop_ids=()):
    """Plain target greedy decoding of up to `n` tokens (ending after the first stop id);
    returns (tokens, logits per token)."""
    from dspark_compile.models.config import CacheConfig, request_positions
    from dspark_compile.models.generate import SamplingParams, set_row_sampling
    from dspark_compile.models.state import allocate_state
    from dspark_compile.models.step import prefill, target_decode_step

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


def check_lossless(model, prompts, params, outputs, device="cpu") -> LosslessReport:
    """Compare each request's output with target-only greedy decoding under its own
    SamplingParams (stop ids, max_new_tokens); returns the first divergence (or ok).

    Greedy only: a request with temperature > 0 has no single right answer to compare with."""
    if not len(prompts) == len(params) == len(outputs):
        raise ValueError(f"{len(prompts)} prompts, {len(params)} sampling params and "
                         f"{len(outputs)} outputs: one of each per request")
    for i, sp in enumerate(params):
        if sp.temperature > 0:
            raise ValueError(f"request {i}: temperature {sp.temperature} > 0; the lossless check "
                             "compares greedy decoding only")
    for i, (prompt, sp, got) in enumerate(zip(prompts, params, outputs)):
        got = list(got)
        ref, logits = greedy_reference(model, prompt, sp.max_new_tokens, device, tuple(sp.stop_ids))
        for j in range(max(len(ref), len(got))):
            a = ref[j] if j < len(ref) else END
            b = got[j] if j < len(got) else END
            if a == b:
                continue
            if END in (a, b):
                return LosslessReport(False, i, j, a, b)
            lg = logits[j].double()
            top2 = lg.topk(2).values
            if not 0 <= b < lg.numel():
                return LosslessReport(False, i, j, a, b, float("inf"), float(top2[0] - top2[1]),
                                      float(top2[0]))
            return LosslessReport(False, i, j, a, b, float(lg[a] - lg[b]),
                                  float(top2[0] - top2[1]), float(top2[0]))
    return LosslessReport(True)
