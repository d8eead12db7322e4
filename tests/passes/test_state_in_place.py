"""assert_no_whole_cache_copy: passes for in-place updates, fails for every whole-state copy,
including the functionalised update run_decompositions() produces (docs/architecture.md,
"Toolchain facts")."""
import pytest
import torch

from dspark_compile.passes import (PassManager, WholeCacheCopyError, assert_no_whole_cache_copy,
                                   find_whole_cache_copies)


class Module(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, cache, slots):
        return self.fn(x, cache, slots)


def export(fn):
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g),
            torch.tensor([0, 2, 3, 5]))
    return torch.export.export(Module(fn), args)


def in_place(x, cache, slots):
    cache.index_copy_(0, slots, x * 2)
    cache[slots] = cache[slots] + 1          # index_put_: in place as well
    return cache[:2].sum(0) + cache.sum()    # reading (views, reductions) copies nothing


def test_in_place_updates_pass():
    ep = export(in_place)
    assert_no_whole_cache_copy(ep, ["cache"])


def test_toy_step_passes_and_fails_after_run_decompositions(toy, toy_export):
    _, ep = toy_export
    assert_no_whole_cache_copy(ep, toy.STATE_INPUTS)
    decomposed = ep.run_decompositions()
    with pytest.raises(WholeCacheCopyError) as e:
        assert_no_whole_cache_copy(decomposed, toy.STATE_INPUTS)
    msg = str(e.value)
    assert "state input 'kv_cache' is returned as a new tensor" in msg
    assert "state input 'ring' is returned as a new tensor" in msg
    assert "aten.index_put.default" in msg and "full shape [16, 32]" in msg
    assert "toy_step.py" in msg and "kv_cache.index_copy_(0, slots, row)" in msg


def test_functionalised_update_fails_on_the_graph_alone():
    # even without the signature's copy-back entry, the index_put node is found
    decomposed = export(in_place).run_decompositions()
    findings = find_whole_cache_copies(decomposed.graph_module, ["cache"])
    assert any("aten.index_put.default" in f for f in findings)


@pytest.mark.parametrize("fn, what", [
    (lambda x, c, s: c.clone().sum(0), "aten.clone.default"),
    (lambda x, c, s: (c * 1).sum(), "aten.mul.Tensor"),
    (lambda x, c, s: c.to(torch.float64).sum(), "aten.to.dtype"),
    (lambda x, c, s: torch.zeros_like(c).copy_(c).sum(), "aten.copy_.default"),
    (lambda x, c, s: c.copy_(torch.zeros(6, 8)).sum(), "aten.copy_.default"),
    (lambda x, c, s: torch.cat([c, x]).sum(), "aten.cat.default"),
], ids=["clone", "elementwise", "dtype_cast", "copy_from_state", "copy_into_state", "cat"])
def test_whole_state_copies_are_named(fn, what):
    ep = export(fn)
    with pytest.raises(WholeCacheCopyError, match="state 'cache'") as e:
        assert_no_whole_cache_copy(ep, ["cache"])
    assert what in str(e.value)


def test_partial_copies_pass():
    ep = export(lambda x, c, s: c[:2].clone().sum() + c.index_select(0, s).sum())
    assert_no_whole_cache_copy(ep, ["cache"])


def _test_op(name: str, fn):
    """A dspark:: op for these tests only (not a registered kernel: no KERNELS entry)."""
    if not hasattr(torch.ops.dspark, name):
        op = torch.library.custom_op(f"dspark::{name}", fn, mutates_args=())
        op.register_fake(fn)
    return getattr(torch.ops.dspark, name)


def _reads_cache(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    return x.new_zeros(64, 8) + cache.sum()          # 512 elements out of a 48-element cache


def _returns_cache_copy(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    return cache + 0


def test_dspark_op_reading_a_whole_cache_passes_and_one_returning_a_copy_fails():
    # an attention kernel reads the caches as stored and returns more than a small cache holds
    read = _test_op("_test_reads_cache", _reads_cache)
    assert_no_whole_cache_copy(export(lambda x, c, s: read(x, c).sum()), ["cache"])
    copy = _test_op("_test_returns_cache_copy", _returns_cache_copy)
    with pytest.raises(WholeCacheCopyError, match="_test_returns_cache_copy.*full shape"):
        assert_no_whole_cache_copy(export(lambda x, c, s: copy(x, c).sum()), ["cache"])


def test_unknown_state_name():
    with pytest.raises(ValueError, match=r"state inputs \['kv'\] are not user inputs"):
        assert_no_whole_cache_copy(export(in_place), ["kv"])


def test_check_runs_in_the_pipeline_with_state_inputs(toy, toy_export):
    _, ep = toy_export
    stats = PassManager().run(ep, state_inputs=toy.STATE_INPUTS)
    assert stats[-1]["name"] == "check_state_in_place"
    decomposed = toy.export_toy()[1].run_decompositions()
    with pytest.raises(WholeCacheCopyError):
        PassManager().run(decomposed, state_inputs=toy.STATE_INPUTS)
