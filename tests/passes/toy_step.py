"""A toy with the features of the draft-plus-verify step, for pass and artifact tests.

- weights: parameters (Linear), a persistent and a non-persistent buffer, MXFP4 expert weights;
- state passed as *inputs and mutated in place*: `kv_cache.index_copy_` and a custom op
  declared with `mutates_args` (`dspark_test::ring_store`, a row store that skips slot -1);
- a `dspark::` op: `torch.ops.dspark.moe_experts`;
- what export inserts or leaves: `_assert_tensor_metadata` before `.to()`, a no-op view,
  a removable `clone`, an unused node.
Loaded by the tests' conftest through importlib (tests are not a package).
"""
from __future__ import annotations

import io

import torch

import dspark_compile.kernels.moe  # noqa: F401  (registers dspark::moe_experts)

D, E, I, S, R = 32, 2, 32, 16, 12   # hidden, experts, intermediate, kv slots, ring slots


def _register_ring_store():
    if hasattr(torch.ops, "dspark_test") and hasattr(torch.ops.dspark_test, "ring_store"):
        return

    @torch.library.custom_op("dspark_test::ring_store", mutates_args={"ring"})
    def ring_store(ring: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        keep = slots >= 0
        idx = torch.where(keep, slots, 0)
        old = ring.index_select(0, idx)
        ring.index_copy_(0, idx, torch.where(keep[:, None], rows.to(ring.dtype), old))

    @ring_store.register_fake
    def _(ring, slots, rows):
        return None


_register_ring_store()


class ToyStep(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = torch.nn.Linear(D, D)
        self.router = torch.nn.Linear(D, E)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        self.register_buffer("scale", torch.randn(D, generator=g))
        self.register_buffer("bias_table", torch.randn(D, generator=g), persistent=False)
        pk = lambda *s: torch.randint(-128, 128, s, generator=g, dtype=torch.int8)  # noqa: E731
        sc = lambda *s: torch.randint(121, 127, s, generator=g, dtype=torch.uint8)  # noqa: E731
        self.register_buffer("w1", pk(E, I, D // 2))
        self.register_buffer("s1", sc(E, I, D // 32))
        self.register_buffer("w3", pk(E, I, D // 2))
        self.register_buffer("s3", sc(E, I, D // 32))
        self.register_buffer("w2", pk(E, D, I // 2))
        self.register_buffer("s2", sc(E, D, I // 32))

    def forward(self, x, slots, ring_slots, kv_cache, ring):
        T = x.shape[0]
        h = self.proj(x.to(torch.float32)).view(T, D)        # no-op .to() and view
        row = h.clone()                                       # copy nobody can observe
        kv_cache.index_copy_(0, slots, row)                   # in-place state update
        probs = self.router(h).softmax(-1)
        w, ids = probs.topk(1, dim=-1)
        y = torch.ops.dspark.moe_experts(h, ids, w, self.w1, self.s1, self.w3, self.s3,
                                         self.w2, self.s2, 7.0)
        torch.ops.dspark_test.ring_store(ring, ring_slots, y)  # custom op mutating its input
        unused = h * 3  # noqa: F841  (dead: dce removes it)
        ctx = kv_cache.sum(0)
        return y + ctx * self.scale + self.bias_table, ids


STATE_INPUTS = ("kv_cache", "ring")


def make_inputs(seed: int, T: int = 4):
    """Fresh random user inputs (x, slots, ring_slots, kv_cache, ring); one padded ring row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    slots = torch.randperm(S, generator=g)[:T]
    ring_slots = torch.randperm(R, generator=g)[:T]
    ring_slots[-1] = -1
    return (x, slots, ring_slots, torch.randn(S, D, generator=g), torch.randn(R, D, generator=g))


def export_toy(T: int = 4, seed: int = 0):
    model = ToyStep(seed).eval()
    return model, torch.export.export(model, make_inputs(0, T))


# ---------------------------------------------------------------- test helpers
class FnModule(torch.nn.Module):
    """A plain function as a module, to export it (the cleanup and cse tests' small cases)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def export_fn(fn, make_inputs):
    """(eager module, program exported on make_inputs(0)) of a plain function."""
    m = FnModule(fn).eval()
    return m, torch.export.export(m, make_inputs(0))


def roundtrip(ep):
    """torch.export.save + load through memory."""
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf)


def assert_same_behaviour(model, program, make_inputs, seeds=(11, 12)):
    """Eager model and program agree on outputs and on every (mutated) input."""
    for seed in seeds:
        a, b = make_inputs(seed), make_inputs(seed)
        with torch.no_grad():
            ref = model(*a)
            got = program.module()(*b)
        torch.testing.assert_close(got, ref, rtol=1.3e-6, atol=1e-5)
        for x, y in zip(b, a):
            torch.testing.assert_close(x, y, rtol=1.3e-6, atol=1e-5)
