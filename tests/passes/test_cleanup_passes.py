"""Cleanup passes: each removes what it should, keeps what it must, preserves numerics on fresh
random inputs (outputs and mutated state) and keeps the program serialisable."""
import sys

import pytest
import torch

from dspark_compile.passes import PassConfig, PassManager

aten = torch.ops.aten


def load_toy():
    return sys.modules["dspark_tests_toy_step"]  # loaded by conftest.py


def targets(ep):
    return [n.target for n in ep.graph_module.graph.nodes if n.op == "call_function"]


def run(ep, names, make_inputs):
    """Run `names` with numeric verification; returns the stats rows."""
    return PassManager(names, config=PassConfig(verify=True, verify_seeds=2)).run(
        ep, input_factory=make_inputs)


def check_kept_behaviour(model, ep, make_inputs):
    """Numerics after save/load in memory equal the eager module."""
    toy = load_toy()
    toy.assert_same_behaviour(model, toy.roundtrip(ep), make_inputs)


def export(fn, make_inputs):
    return load_toy().export_fn(fn, make_inputs)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ on the toy step
@pytest.mark.parametrize("name", ["remove_asserts", "remove_noops", "dce"])
def test_each_cleanup_pass_on_the_toy_step(toy, toy_export, name):
    model, ep = toy_export
    stats = run(ep, [name], toy.make_inputs)
    assert stats[0]["matches"] > 0 and stats[0]["verified"]
    check_kept_behaviour(model, ep, toy.make_inputs)


def test_cleanup_pipeline_on_the_toy_step(toy, toy_export):
    model, ep = toy_export
    run(ep, ["remove_asserts", "remove_noops", "dce"], toy.make_inputs)
    t = targets(ep)
    for gone in (aten._assert_tensor_metadata.default, aten.to.dtype, aten.view.default,
                 aten.clone.default):
        assert gone not in t
    # side effects and the dspark op survive; the dead `h * 3` is gone
    assert aten.index_copy_.default in t
    assert torch.ops.dspark_test.ring_store.default in t
    assert torch.ops.dspark.moe_experts.default in t
    assert aten.mul.Tensor in t and sum(x == aten.mul.Tensor for x in t) == 1
    check_kept_behaviour(model, ep, toy.make_inputs)


# ------------------------------------------------------------------ remove_asserts
def _scalar_inputs(seed):
    return (torch.randn(4, 16, generator=gen(seed)), torch.tensor(seed % 4))


def test_remove_asserts_removes_scalar_and_metadata_asserts():
    def fn(x, n):
        k = n.item()
        torch._check(k >= 0)
        torch._check(k < 4)
        return x.to(torch.float32)[k] * 2

    model, ep = export(fn, _scalar_inputs)
    before = targets(ep)
    assert aten._assert_scalar.default in before
    assert aten._assert_tensor_metadata.default in before
    stats = run(ep, ["remove_asserts", "dce"], _scalar_inputs)
    after = targets(ep)
    assert aten._assert_scalar.default not in after
    assert aten._assert_tensor_metadata.default not in after
    assert stats[0]["matches"] == before.count(aten._assert_scalar.default) + 1
    assert stats[1]["matches"] >= 3   # the comparisons that fed the assertions
    assert aten.item.default in after  # the value is still used
    check_kept_behaviour(model, ep, _scalar_inputs)


def test_remove_asserts_handles_constrain_range_nodes():
    # torch 2.13 lowers torch._check_is_size to _assert_scalar; older versions emit
    # sym_constrain_range_for_size. Insert one by hand to cover it.
    def fn(x, n):
        return x[n.item()] * 2

    model, ep = export(fn, _scalar_inputs)
    g = ep.graph_module.graph
    item = next(n for n in g.nodes if n.target == aten.item.default)
    with g.inserting_after(item):
        c = g.call_function(aten.sym_constrain_range_for_size.default, (item,), {"min": 0,
                                                                                 "max": 3})
    c.meta["val"] = None
    ep.graph_module.recompile()
    stats = run(ep, ["remove_asserts"], _scalar_inputs)
    assert aten.sym_constrain_range_for_size.default not in targets(ep)
    assert stats[0]["notes"]["removed"]["aten.sym_constrain_range_for_size.default"] == 1
    check_kept_behaviour(model, ep, _scalar_inputs)


# ------------------------------------------------------------------ remove_noops
def _xc(seed):
    g = gen(seed)
    return (torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g),
            torch.randperm(6, generator=g)[:4])


def test_remove_noops_removes_views_and_unobservable_copies():
    def fn(x, cache, slots):
        a = x.view(4, 8).reshape(4, 8)             # same shape: no-op views
        b = torch.ops.aten.alias(a).to(torch.float32)
        c = b.clone()                              # nobody writes b or c: unobservable
        cache.index_copy_(0, slots, c)
        return c.permute(0, 1) * 2 + x.expand(4, 8)

    model, ep = export(fn, _xc)
    stats = run(ep, ["remove_noops"], _xc)
    t = targets(ep)
    for gone in (aten.view.default, aten.alias.default, aten.to.dtype, aten.clone.default,
                 aten.permute.default, aten.expand.default):
        assert gone not in t, gone
    assert stats[0]["matches"] >= 6
    assert aten.index_copy_.default in t
    check_kept_behaviour(model, ep, _xc)


def test_remove_noops_keeps_copies_that_can_be_observed():
    def fn(x, cache, slots):
        written = x.clone()
        written.add_(1)                            # the copy is written: keep
        snap = cache.clone()                       # the source is written later: keep
        cache.index_copy_(0, slots, x)
        returned = x.clone()                       # returned: must not alias the input x
        return written + snap.sum(0), returned

    model, ep = export(fn, _xc)
    n_clones = targets(ep).count(aten.clone.default)
    stats = run(ep, ["remove_noops"], _xc)
    assert targets(ep).count(aten.clone.default) == n_clones == 3
    assert stats[0]["notes"]["kept_copies"] == 3
    check_kept_behaviour(model, ep, _xc)


def test_remove_noops_keeps_views_that_change_layout_and_real_conversions():
    def fn(x, cache, slots):
        return x.view(8, 4).t(), x.to(torch.float64), x.clone(
            memory_format=torch.contiguous_format).transpose(0, 1).contiguous()

    model, ep = export(fn, _xc)
    before = targets(ep)
    run(ep, ["remove_noops"], _xc)
    after = targets(ep)
    assert aten.view.default in after and aten.t.default in after
    assert aten.to.dtype in after
    assert before.count(aten.clone.default) == after.count(aten.clone.default)
    check_kept_behaviour(model, ep, _xc)


def test_remove_noops_on_a_returned_view_keeps_the_program_serialisable():
    def fn(x, cache, slots):
        return x.view(4, 8), (x * 2).reshape(4, 8)

    model, ep = export(fn, _xc)
    run(ep, ["remove_noops"], _xc)
    assert aten.view.default not in targets(ep)
    x_name = ep.graph_signature.user_inputs[0]
    assert [s.arg.name for s in ep.graph_signature.output_specs] == [x_name, "mul"]
    check_kept_behaviour(model, ep, _xc)


# ------------------------------------------------------------------ dce
def test_dce_removes_dead_chains_and_keeps_side_effects(toy):
    def fn(x, cache, slots):
        dead = (x + 1) * 2                           # noqa: F841  dead chain
        cache.index_copy_(0, slots, x)               # result unused: in place, keep
        torch.ops.dspark_test.ring_store(cache, slots, x * 3)  # custom op mutating: keep
        torch.rand(3)                                # unused RNG draw: keep (shifts the stream)
        torch._check(slots.shape[0] == 4)
        return x.sum()

    model, ep = export(fn, _xc)
    t0 = targets(ep)
    stats = run(ep, ["dce"], _xc)
    t = targets(ep)
    assert stats[0]["matches"] == 2                  # add, mul of the dead chain
    assert aten.add.Tensor not in t
    assert aten.index_copy_.default in t
    assert torch.ops.dspark_test.ring_store.default in t
    assert aten.rand.default in t
    assert t0.count(aten.mul.Tensor) - 1 == t.count(aten.mul.Tensor)
    check_kept_behaviour(model, ep, _xc)


def test_dce_keeps_assertions():
    def fn(x, n):
        k = n.item()
        torch._check(k < 4)
        return x * 2

    _, ep = export(fn, _scalar_inputs)
    n_asserts = targets(ep).count(aten._assert_scalar.default)
    assert n_asserts >= 1
    run(ep, ["dce"], _scalar_inputs)
    assert targets(ep).count(aten._assert_scalar.default) == n_asserts


def test_remove_noops_removes_to_copy_and_forced_copies():
    # `.to(copy=True)` is a copy in the exported IR and `_to_copy` once decomposed; neither is
    # observable here.
    def fn(x, cache, slots):
        return x.to(torch.float32, copy=True) * 2 + x.to(torch.float32)

    model, ep = export(fn, _xc)
    run(ep, ["remove_noops"], _xc)
    assert aten.to.dtype not in targets(ep)
    check_kept_behaviour(model, ep, _xc)

    decomposed = export(fn, _xc)[1].run_decompositions()
    assert aten._to_copy.default in targets(decomposed)
    run(decomposed, ["remove_noops"], _xc)
    assert aten._to_copy.default not in targets(decomposed)
    check_kept_behaviour(model, decomposed, _xc)
