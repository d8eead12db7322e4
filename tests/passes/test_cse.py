"""passes/cse.py: repeated pure glue is computed once; nothing observable is merged.

Each case exports a small function, runs the pass with numeric verification on fresh random
inputs (outputs and every mutated input compared), and checks what was merged and what was kept:
reads of a tensor before and after its in-place update, a buffer that is written later, graph
outputs, random draws and arguments that only look alike (0.0 vs -0.0) must stay apart.
"""
import sys

import torch

from dspark_compile.passes import PassConfig, PassManager
from dspark_compile.passes.cse import eliminate_common_subexpressions

aten = torch.ops.aten


def _export(fn, make_inputs):
    return sys.modules["dspark_tests_toy_step"].export_fn(fn, make_inputs)   # conftest loads it


def _run(ep, make_inputs):
    stats = PassManager(["cse"], config=PassConfig(verify=True, verify_seeds=2)).run(
        ep, input_factory=make_inputs)
    assert stats[0]["verified"]
    return stats[0]


def _count(ep, target):
    return sum(n.target == target for n in ep.graph_module.graph.nodes)


def _same(model, ep, make_inputs):
    for seed in (5, 6):
        a, b = make_inputs(seed), make_inputs(seed)
        ref, got = model(*a), ep.module()(*b)
        for x, y in zip(ref if isinstance(ref, tuple) else (ref,),
                        got if isinstance(got, tuple) else (got,)):
            assert torch.equal(x, y)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _slots_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 9, (4,), generator=g), torch.randint(0, 100, (4, 6), generator=g),
            torch.randn(4, 6, generator=g))


def test_repeated_ring_slot_chains_collapse():
    """The per-layer bookkeeping pattern: the same slots computed three times from the batch."""
    def fn(rows, pos, x):
        out = x
        for _ in range(3):
            slots = rows[:, None] * 8 + pos % 8
            newest = torch.where(slots >= 0, pos, torch.full_like(pos, -1)).amax(1, keepdim=True)
            out = out + (slots * (pos > newest - 8)).float()
        return out

    model, ep = _export(fn, _slots_inputs)
    before = _count(ep, aten.remainder.Scalar)
    stat = _run(ep, _slots_inputs)
    assert before == 3 and _count(ep, aten.remainder.Scalar) == 1
    assert _count(ep, aten.amax.default) == 1 and _count(ep, aten.full_like.default) == 1
    assert _count(ep, aten.add.Tensor) >= 3            # the accumulation differs each time
    assert stat["matches"] >= 10
    _same(model, ep, _slots_inputs)


def _state_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(5, 4, generator=g), torch.randint(0, 5, (2,), generator=g),
            torch.randn(2, 4, generator=g))


def test_reads_around_an_in_place_write_stay_apart():
    def fn(cache, slots, rows):
        a = cache * 2                                 # before the write
        cache.index_put_((slots,), rows)
        b = cache * 2                                 # after: another value
        c = slots + 1                                 # slots is never written: merged
        d = slots + 1
        return a + b, c * d

    model, ep = _export(fn, _state_inputs)
    _run(ep, _state_inputs)
    assert _count(ep, aten.mul.Tensor) >= 2           # cache * 2 twice, c * d
    assert _count(ep, aten.add.Tensor) == 2           # a + b and one slots + 1
    _same(model, ep, _state_inputs)


def test_written_buffers_outputs_random_and_signed_zeros_stay_apart():
    def fn(x):
        buf1 = torch.zeros_like(x)
        buf1.add_(x)                                  # written in place: its own buffer
        buf2 = torch.zeros_like(x)
        r1, r2 = torch.rand_like(x), torch.rand_like(x)
        p, n = (x + 0.0).neg(), (x + -0.0).neg()      # not the same argument: -0.0 + 0.0 is
        return buf1 + buf2, x * 3, x * 3, r1 - r2, p, n  # 0.0, -0.0 + -0.0 is -0.0

    g = lambda seed: (torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)),)
    _, ep = _export(fn, g)
    stats = PassManager(["cse"]).run(ep)
    assert _count(ep, aten.zeros_like.default) == 2
    assert _count(ep, aten.rand_like.default) == 2
    assert _count(ep, aten.mul.Tensor) == 2           # both returned: must not alias
    assert _count(ep, aten.add.Tensor) == 3           # buf1 + buf2, x + 0.0, x + -0.0
    assert stats[0]["matches"] == 0
    x = -torch.zeros(3, 4)
    out = ep.module()(x)
    assert torch.equal(torch.signbit(out[4]), torch.ones(3, 4, dtype=torch.bool))   # -(0.0)
    assert torch.equal(torch.signbit(out[5]), torch.zeros(3, 4, dtype=torch.bool))  # -(-0.0)


def test_merges_whole_chains_in_one_sweep():
    def fn(x):
        return (x.sin() * 2).exp() + (x.sin() * 2).exp()

    g = lambda seed: (torch.randn(3, generator=torch.Generator().manual_seed(seed)),)
    model, ep = _export(fn, g)
    merged = eliminate_common_subexpressions(ep.graph_module.graph)
    ep.graph_module.recompile()
    assert merged == {"sin.default": 1, "mul.Tensor": 1, "exp.default": 1}
    _same(model, ep, g)


def test_on_the_tiny_step_ring_slots_are_computed_once_per_ring(tiny_step):
    """After the fusions, the step's repeated bookkeeping collapses: one `dspark::ring_slots`
    call per distinct ring (SWA window, compressor rings, draft context) instead of one per
    layer, with the step's outputs and state updates unchanged on fresh inputs."""
    ep = tiny_step.cleaned()
    fusions = ["fuse_act_quant", "fuse_mhc", "fuse_qkv_postprocess", "fuse_sampler",
               "fuse_ring_slots", "drop_region_markers"]
    PassManager(fusions).run(ep, state_inputs=tiny_step.states(ep))
    op = torch.ops.dspark.ring_slots.default
    before = _count(ep, op)
    stats = PassManager(["cse"], config=PassConfig(verify=True, verify_seeds=1)).run(
        ep, input_factory=tiny_step.inputs, state_inputs=tiny_step.states(ep))
    assert stats[0]["verified"] and stats[0]["notes"]["merged"]["ring_slots.default"] > 0
    calls = [n for n in ep.graph_module.graph.nodes if n.target == op]
    keys = {(tuple(a.name if isinstance(a, torch.fx.Node) else a for a in n.args)) for n in calls}
    assert len(calls) == len(keys) < before
