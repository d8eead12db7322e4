"""The lossless check: greedy speculative output vs greedy decoding of the target alone.

On a mismatch the report names the first diverging position and the target's logit margin
there (top-1 minus the engine's token, and top-1 minus top-2), so a flip caused by a near-tie
in low precision is told apart from a real bug.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LosslessReport:
    ok: bool
    request: int = -1
    index: int = -1
    expected: int = -1
    got: int = -1
    margin: float = 0.0        # logit[expected] - logit[got] at the divergence
    top2_gap: float = 0.0      # top-1 minus top-2 logit there

    def line(self) -> str:
        if self.ok:
            return "lossless: ok"
        return (f"lossless: DIVERGED at request {self.request}, token {self.index}: target greedy "
                f"{self.expected}, engine {self.got}; logit margin {self.margin:.3e} "
                f"(top-1 minus top-2 {self.top2_gap:.3e})")


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int, device="cpu"):
    """Plain target greedy decoding of `n` tokens; returns (tokens, logits per token)."""
    from .models.config import CacheConfig
    from .models.generate import SamplingParams, set_row_sampling
    from .models.state import allocate_state
    from .models.step import prefill, target_decode_step

    cache = CacheConfig(max_rows=1, max_seq_len=len(prompt) + n + 2, max_step_tokens=64)
    state = allocate_state(model.cfg, cache, model.prec, device)
    set_row_sampling(state, 0, SamplingParams())
    tok, logits = prefill(model, state, 0, prompt, cache.max_step_tokens, speculative=False,
                          return_logits=True)
    tokens, all_logits = [tok], [logits]
    rows = torch.tensor([0], device=device)
    while len(tokens) < n:
        nxt, logits = target_decode_step(model, state, rows, torch.tensor([tokens[-1]], device=device))
        tokens.append(int(nxt[0]))
        all_logits.append(logits[0])
    return tokens, all_logits


def check_lossless(model, prompts, params, outputs, device="cpu") -> LosslessReport:
    for i, (prompt, sp, got) in enumerate(zip(prompts, params, outputs)):
        ref, logits = greedy_reference(model, prompt, len(got), device)
        for j, (a, b) in enumerate(zip(ref, got)):
            if a != b:
                lg = logits[j].double()
                top2 = lg.topk(2).values
                return LosslessReport(False, i, j, a, b, float(lg[a] - lg[b]), float(top2[0] - top2[1]))
    return LosslessReport(True)
