"""PassManager and registry: ordering, build-time errors, instruments, verification."""
import hashlib
import inspect
import os

import pytest
import torch

import dspark_compile.passes as passes
from dspark_compile.passes import (PassConfig, PassContractError, PassManager, PassNoMatchWarning,
                                   PassPipelineError, PassRegistry, PassResult,
                                   PassVerificationError, register_pass)

aten = torch.ops.aten


def _noop(gm, ctx):
    return 0


def registry(**decls):
    """decls: name -> dict(requires=, after=, stage=, default=) -> a fresh PassRegistry."""
    reg = PassRegistry()
    for name, d in decls.items():
        register_pass(name=name, registry=reg, **d)(_noop)
    return reg


def order(reg, names=None, config=None):
    return [s.name for s in reg.build_pipeline(names, config)]


# ------------------------------------------------------------------ ordering
def test_requires_and_after_order_the_pipeline():
    reg = registry(a={}, b={"after": ("c",)}, c={"requires": ("a",)})
    assert order(reg, ["b", "c", "a"]) == ["a", "c", "b"]


def test_after_is_soft():
    reg = registry(a={}, b={"after": ("c",)}, c={})
    assert order(reg, ["b"]) == ["b"]
    assert order(reg, ["b", "c"]) == ["c", "b"]


def test_tie_break_is_caller_order_then_name():
    reg = registry(x={}, y={}, z={})
    assert order(reg, ["z", "x", "y"]) == ["z", "x", "y"]
    assert order(reg) == ["x", "y", "z"]  # default pipeline: by name, not import order


def test_stage_orders_lint_after_fusions():
    reg = registry(lint={"stage": "lint"}, fuse={}, clean={"stage": "cleanup"})
    assert order(reg, ["lint", "fuse", "clean"]) == ["clean", "fuse", "lint"]


def test_default_flag_and_disabled():
    reg = registry(a={}, b={"default": False}, c={})
    assert order(reg) == ["a", "c"]
    assert order(reg, config=PassConfig(disabled={"c"})) == ["a"]


def test_builtin_default_pipeline():
    assert PassManager().names == ["remove_asserts", "remove_noops", "dce", "fuse_act_quant",
                                   "fuse_mhc", "fuse_qkv_postprocess", "fuse_ring_slots",
                                   "fuse_sampler", "drop_region_markers", "cse", "group_fp8_linears",
                                   "lint_host_sync", "check_state_in_place"]


# ------------------------------------------------------------------ build-time errors
def test_cycle_is_an_error_naming_the_passes():
    reg = registry(a={"requires": ("b",)}, b={"after": ("a",)}, c={})
    with pytest.raises(PassPipelineError, match="cycle") as e:
        order(reg, ["a", "b", "c"])
    assert "a -> b -> a" in str(e.value) or "b -> a -> b" in str(e.value)
    assert "'c'" not in str(e.value)


def test_stage_contradiction_is_a_cycle():
    reg = registry(clean={"stage": "cleanup", "requires": ("fuse",)}, fuse={})
    with pytest.raises(PassPipelineError, match=r"cycle.*\(stage\)"):
        order(reg, ["clean", "fuse"])


def test_missing_dependency_names_both_passes():
    reg = registry(a={}, c={"requires": ("a",)})
    with pytest.raises(PassPipelineError, match=r"pass 'c' requires 'a', which is not in the "):
        order(reg, ["c"])


def test_unregistered_dependency():
    reg = registry(c={"requires": ("zzz",)})
    with pytest.raises(PassPipelineError, match=r"'c' requires 'zzz', which is not registered"):
        order(reg, ["c"])


def test_disabled_dependency():
    reg = registry(a={}, c={"requires": ("a",)})
    with pytest.raises(PassPipelineError, match=r"'c' requires 'a', which is disabled"):
        order(reg, config=PassConfig(disabled={"a"}))


def test_unknown_and_duplicate_pass():
    reg = registry(a={})
    with pytest.raises(PassPipelineError, match="unknown pass 'nope'"):
        order(reg, ["nope"])
    with pytest.raises(PassPipelineError, match="registered twice"):
        register_pass(name="a", registry=reg)(_noop)
    with pytest.raises(PassPipelineError, match="stage must be one of"):
        register_pass(name="q", registry=reg, stage="late")(_noop)


# ------------------------------------------------------------------ source hash / config hash
def test_source_hash_is_sha256_of_the_module_file():
    spec = passes.REGISTRY["dce"]
    path = inspect.getsourcefile(passes.dce)
    assert spec.source_hash == hashlib.sha256(open(path, "rb").read()).hexdigest()
    entries = PassManager().manifest_entries()
    assert {e["name"]: e["source_hash"] for e in entries}["dce"] == spec.source_hash


def test_source_hash_of_code_without_a_file_changes_with_the_code():
    ns1, ns2 = {}, {}
    exec("def p(gm, ctx):\n    return 1\n", ns1)
    exec("def p(gm, ctx):\n    return 2\n", ns2)
    h1, h2 = passes.source_hash(ns1["p"]), passes.source_hash(ns2["p"])
    assert len(h1) == 64 and h1 != h2


def test_pass_config_hash_covers_what_changes_the_program():
    base = PassConfig()
    assert PassConfig(disabled={"dce"}).hash() != base.hash()
    assert PassConfig(options={"x": {"k": 1}}).hash() != base.hash()
    assert PassConfig(dump_dir="/tmp/x", verify=True).hash() == base.hash()


# ------------------------------------------------------------------ instruments
def test_stats_rows_and_table(toy, toy_export):
    _, ep = toy_export
    pm = PassManager()
    stats = pm.run(ep, state_inputs=toy.STATE_INPUTS)
    assert [r["name"] for r in stats] == pm.names
    for prev, row in zip(stats, stats[1:]):
        assert row["nodes_before"] == prev["nodes_after"]
    for row in stats:
        assert row["time_ms"] >= 0 and len(row["source_hash"]) == 64
    by = {r["name"]: r for r in stats}
    assert by["remove_asserts"]["matches"] == 1   # one .to() -> one _assert_tensor_metadata
    assert by["remove_noops"]["matches"] == 3     # .to(float32), view, clone
    assert by["dce"]["matches"] == 1              # h * 3
    assert by["dce"]["nodes_after"] == by["remove_asserts"]["nodes_before"] - 5
    table = pm.format_stats()
    assert table.splitlines()[0].split()[:4] == ["index", "name", "stage", "time_ms"]
    assert all(n in table for n in pm.names)


def test_graph_dumps(toy, toy_export, tmp_path):
    _, ep = toy_export
    pm = PassManager(["remove_asserts", "dce"], config=PassConfig(dump_dir=str(tmp_path)))
    pm.run(ep)
    files = sorted(os.listdir(tmp_path))
    assert files == ["00_remove_asserts.after.txt", "00_remove_asserts.before.txt",
                     "01_dce.after.txt", "01_dce.before.txt", "passes.txt"]
    before = (tmp_path / "00_remove_asserts.before.txt").read_text()
    after = (tmp_path / "00_remove_asserts.after.txt").read_text()
    assert "_assert_tensor_metadata" in before and "_assert_tensor_metadata" not in after
    assert "remove_asserts" in (tmp_path / "passes.txt").read_text()


def test_verify_passes_for_the_default_pipeline(toy, toy_export):
    _, ep = toy_export
    pm = PassManager(config=PassConfig(verify=True))
    stats = pm.run(ep, input_factory=toy.make_inputs, state_inputs=toy.STATE_INPUTS)
    assert all(r["verified"] for r in stats)


def _run_wrong(toy, toy_export, fn, **kw):
    _, ep = toy_export
    reg = passes.REGISTRY.copy()
    register_pass(name="wrong", registry=reg, stage="cleanup")(fn)
    pm = PassManager(["wrong"], config=PassConfig(verify=True, **kw), registry=reg)
    return pm.run(ep, input_factory=toy.make_inputs)


def test_verify_catches_a_pass_that_changes_an_output(toy, toy_export):
    def add_to_sub(gm, ctx):
        n = next(n for n in gm.graph.nodes if n.target == aten.add.Tensor)
        n.target = aten.sub.Tensor
        return 1

    with pytest.raises(PassVerificationError, match=r"(?s)pass 'wrong' changed.*output 0"):
        _run_wrong(toy, toy_export, add_to_sub)


def test_verify_catches_a_pass_that_drops_a_state_update(toy, toy_export):
    # The ring store feeds no output: only the mutated input shows the bug.
    def drop_ring_store(gm, ctx):
        n = next(n for n in gm.graph.nodes if "ring_store" in str(n.target))
        gm.graph.erase_node(n)
        return 1

    with pytest.raises(PassVerificationError,
                       match=r"(?s)pass 'wrong'.*input 'ring' after the run") as e:
        _run_wrong(toy, toy_export, drop_ring_store)
    assert "output" not in str(e.value)


def test_verify_nan_never_passes(toy, toy_export):
    _, ep = toy_export

    def nan_inputs(seed):
        x, *rest = toy.make_inputs(seed)
        x[0, 0] = float("nan")
        return (x, *rest)

    pm = PassManager(["dce"], config=PassConfig(verify=True))
    with pytest.raises(PassVerificationError, match="NaN in the reference run"):
        pm.run(ep, input_factory=nan_inputs)


def test_verify_needs_an_input_factory(toy_export):
    with pytest.raises(ValueError, match="input_factory"):
        PassManager(["dce"], config=PassConfig(verify=True)).run(toy_export[1])


def test_expect_match_warns_when_nothing_matched(toy_export):
    _, ep = toy_export
    reg = PassRegistry()
    register_pass(name="finds_nothing", registry=reg, expect_match=True)(_noop)
    register_pass(name="finds_one", registry=reg, expect_match=True)(lambda gm, ctx: 1)
    with pytest.warns(PassNoMatchWarning, match="'finds_nothing'"):
        PassManager(["finds_nothing"], registry=reg).run(ep)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", PassNoMatchWarning)
        PassManager(["finds_one"], registry=reg).run(ep)


def test_inserted_node_without_meta_val_is_named(toy_export):
    _, ep = toy_export

    def no_meta(gm, ctx):
        add = next(n for n in gm.graph.nodes if n.target == aten.add.Tensor)
        with gm.graph.inserting_after(add):
            new = gm.graph.call_function(aten.mul.Tensor, (add, 1.0))
        add.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        return 1

    reg = PassRegistry()
    register_pass(name="no_meta", registry=reg)(no_meta)
    with pytest.raises(PassContractError, match=r"pass 'no_meta' left nodes without meta\['val'\]"):
        PassManager(["no_meta"], registry=reg).run(ep)


def test_changing_placeholders_is_refused(toy_export):
    _, ep = toy_export

    def add_input(gm, ctx):
        first = next(iter(gm.graph.nodes))
        with gm.graph.inserting_before(first):
            gm.graph.placeholder("extra")
        return 1

    reg = PassRegistry()
    register_pass(name="add_input", registry=reg)(add_input)
    with pytest.raises(PassContractError,
                       match="pass 'add_input' changed the graph's placeholders"):
        PassManager(["add_input"], registry=reg).run(ep)


def test_bad_return_value_and_crash_are_named(toy_export):
    _, ep = toy_export
    reg = PassRegistry()
    register_pass(name="returns_str", registry=reg)(lambda gm, ctx: "done")
    register_pass(name="crashes", registry=reg)(lambda gm, ctx: 1 / 0)
    with pytest.raises(PassContractError, match="pass 'returns_str' returned str"):
        PassManager(["returns_str"], registry=reg).run(ep)
    with pytest.raises(passes.PassError, match="pass 'crashes' failed: ZeroDivisionError"):
        PassManager(["crashes"], registry=reg).run(ep)


def test_class_pass_options_and_instruments(toy_export):
    _, ep = toy_export
    reg = PassRegistry()
    seen = []

    @register_pass(name="counter", registry=reg)
    class CountAdds:
        """Counts adds (a small class pass)."""

        def __call__(self, gm, ctx):
            seen.append(ctx.options())
            return PassResult(sum(n.target == aten.add.Tensor for n in gm.graph.nodes),
                              notes={"k": 1})

    class Recorder:
        def __init__(self):
            self.calls = []

        def before_pass(self, spec, gm, ctx):
            self.calls.append(("before", spec.name))

        def after_pass(self, spec, gm, ctx, row):
            self.calls.append(("after", spec.name, row["matches"]))

    rec = Recorder()
    cfg = PassConfig(options={"counter": {"threshold": 3}})
    stats = PassManager(["counter"], config=cfg, registry=reg, instruments=[rec]).run(ep)
    assert seen == [{"threshold": 3}]
    assert stats[0]["matches"] == 2 and stats[0]["notes"] == {"k": 1}
    assert reg["counter"].description == "Counts adds (a small class pass)."
    assert rec.calls == [("before", "counter"), ("after", "counter", 2)]



def test_replaced_output_node_keeps_program_serialisable(toy, toy_export):
    model, ep = toy_export

    def rebuild_output(gm, ctx):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        last = out.args[0][0]
        with gm.graph.inserting_before(out):
            new = gm.graph.call_function(aten.mul.Tensor, (last, 1.0))
        new.meta.update(last.meta)
        out.replace_input_with(last, new)
        return 1

    reg = PassRegistry()
    register_pass(name="rebuild_output", registry=reg)(rebuild_output)
    PassManager(["rebuild_output"], registry=reg).run(ep)
    names = [s.arg.name for s in ep.graph_signature.output_specs]
    assert names[0].startswith("mul")
    import io
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    a, b = toy.make_inputs(3), toy.make_inputs(3)
    torch.testing.assert_close(loaded.module()(*a), model(*b))
