"""passes/group_fp8_linears.py: the FP8 linears that read one activation become one
fp8_linear_multi call; outputs unchanged bit for bit; what may not be grouped is left alone.

Small programs (buffers as weights, exported) show each rule; the tiny model's step shows what
the pass finds in the model: per attention layer wq_a + wkv, per C4 layer wq_b + the indexer's
wq_b, per block the shared expert's w1 + w3, and the draft layers' context-KV wkv together.
"""
import operator

import pytest
import torch

from dspark_compile.kernels import fp8_linear_multi  # noqa: F401  (registers the op)
from dspark_compile.kernels.act_quant import act_quant_reference
from dspark_compile.models.quant_formats import fp8_block_quant
from dspark_compile.passes import PassConfig, PassManager

LINEAR = torch.ops.dspark.fp8_linear.default
MULTI = torch.ops.dspark.fp8_linear_multi.default
K = 256


class Linears(torch.nn.Module):
    """Buffers w{i} [N_i, K] and s{i}; `body(self, x, x_s)` calls the linears."""

    def __init__(self, Ns, body):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for i, N in enumerate(Ns):
            w, s = fp8_block_quant(torch.randn(N, K, generator=g) * 0.05)
            self.register_buffer(f"w{i}", w)
            self.register_buffer(f"s{i}", s.view(torch.uint8))
        self.body = body

    def lin(self, i, x, x_s, dtype=torch.bfloat16, groups=1):
        return torch.ops.dspark.fp8_linear(x, x_s, getattr(self, f"w{i}"),
                                           getattr(self, f"s{i}"), groups, dtype)

    def forward(self, x, x_s):
        return self.body(self, x, x_s)


def _inputs(seed, M=5, width=K):
    x = torch.randn(M, width, generator=torch.Generator().manual_seed(seed)) * 3
    return act_quant_reference(x)


def _grouped(Ns, body, M=5, width=K):
    """(eager module, program after the pass, pass stats); the pass is numerically verified."""
    model = Linears(Ns, body).eval()
    ep = torch.export.export(model, _inputs(0, M, width))
    stats = PassManager(["group_fp8_linears"], PassConfig(verify=True, verify_seeds=2)).run(
        ep, input_factory=lambda seed: _inputs(seed, M, width))
    assert stats[0]["verified"]
    for seed in (3, 4):
        want, got = model(*_inputs(seed, M, width)), ep.module()(*_inputs(seed, M, width))
        for a, b in zip(want, got):
            assert torch.equal(a, b)
    return model, ep, stats[0]


def _count(ep, target):
    return sum(n.target is target for n in ep.graph_module.graph.nodes)


def test_linears_of_one_activation_become_one_call_placed_before_the_first():
    def body(m, x, x_s):
        a = m.lin(0, x, x_s)
        h = a.float().sum()                        # something between the members
        b = m.lin(1, x, x_s)
        return a, b * h, m.lin(2, x, x_s)

    _, ep, stat = _grouped((128, 320, 64), body)
    assert _count(ep, LINEAR) == 0 and _count(ep, MULTI) == 1
    assert stat["matches"] == 3 and stat["notes"] == {"nodes_by_size": {3: 1},
                                                      "launches_saved": 2}
    nodes = list(ep.graph_module.graph.nodes)
    multi = next(n for n in nodes if n.target is MULTI)
    items = [n for n in nodes if n.target is operator.getitem and n.args[0] is multi]
    assert sorted(n.args[1] for n in items) == [0, 1, 2]
    assert multi.args[8:10] == (None, None)                   # the fourth slot unused
    assert [tuple(v.shape) for v in multi.meta["val"]] == [(5, 128), (5, 320), (5, 64), (5, 0)]
    sums = [n for n in nodes if n.target is torch.ops.aten.sum.default]
    assert nodes.index(multi) < nodes.index(sums[0])


def test_five_linears_make_a_call_of_four_and_one_left():
    def body(m, x, x_s):
        return tuple(m.lin(i, x, x_s) for i in range(5))

    _, ep, stat = _grouped((128,) * 5, body)
    assert _count(ep, MULTI) == 1 and _count(ep, LINEAR) == 1
    assert stat["notes"]["nodes_by_size"] == {4: 1}


def test_different_activations_dtypes_and_groups_stay_apart():
    """Other x, other out_dtype, grouped wo_a (groups 2): no shared call for those."""
    def body(m, x, x_s):
        x2, s2 = act_quant_reference(x.float() * 2)
        return (m.lin(0, x, x_s), m.lin(1, x2, s2), m.lin(2, x, x_s, torch.float32),
                m.lin(3, torch.cat([x, x], 1), torch.cat([x_s, x_s], 1), groups=2))

    _, ep, stat = _grouped((128, 128, 128, 256), body)
    assert _count(ep, MULTI) == 0 and _count(ep, LINEAR) == 4 and stat["matches"] == 0


def test_weights_that_are_not_graph_inputs_stay_apart():
    """A weight computed in the graph (here a copy) is not a placeholder: the call stays."""
    def body(m, x, x_s):
        w = m.w1.view(torch.uint8).clone().view(torch.float8_e4m3fn)
        return (m.lin(0, x, x_s), torch.ops.dspark.fp8_linear(x, x_s, w, m.s1, 1, torch.bfloat16),
                m.lin(2, x, x_s))

    _, ep, stat = _grouped((128, 128, 128), body)
    assert _count(ep, MULTI) == 1 and _count(ep, LINEAR) == 1
    multi = next(n for n in ep.graph_module.graph.nodes if n.target is MULTI)
    assert all(a is None or a.op == "placeholder" for a in multi.args[2:10])


def test_an_activation_written_in_place_is_never_grouped():
    """x written between two reads: the later read must not move before the write."""
    def body(m, x, x_s):
        a = m.lin(0, x, x_s)
        x_s.mul_(2.0)
        return a, m.lin(1, x, x_s)

    model = Linears((128, 128), body).eval()
    ep = torch.export.export(model, _inputs(0))
    stats = PassManager(["group_fp8_linears"]).run(ep)
    assert stats[0]["matches"] == 0 and _count(ep, LINEAR) == 2
    want, got = model(*_inputs(5)), ep.module()(*_inputs(5))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_grouped_program_round_trips_through_save_and_load(tmp_path):
    def body(m, x, x_s):
        return m.lin(0, x, x_s), m.lin(1, x, x_s)

    model, ep, _ = _grouped((128, 320), body)
    torch.export.save(ep, tmp_path / "p.pt2")
    loaded = torch.export.load(tmp_path / "p.pt2")
    assert _count(loaded, MULTI) == 1
    got = loaded.module()(*_inputs(7))
    assert all(torch.equal(a, b) for a, b in zip(model(*_inputs(7)), got))


# ------------------------------------------------------------------------------------------------
# the tiny model's step
# ------------------------------------------------------------------------------------------------

FUSIONS = ["fuse_act_quant", "fuse_mhc", "fuse_qkv_postprocess", "fuse_ring_slots",
           "fuse_sampler", "drop_region_markers", "cse"]


def _expected_sets(model, cfg) -> dict:
    """{size: nodes}: pairs for wq_a + wkv per attention layer (target and draft), wq_b + the
    indexer's wq_b per C4 layer, w1 + w3 per shared expert; and one set of every draft layer's
    context-KV wkv, which all read the target's main_x (models/draft.py)."""
    from dspark_compile.models.attention import Attention, Indexer
    from dspark_compile.models.moe import SharedExpert
    pairs = sum(isinstance(m, (Attention, Indexer, SharedExpert)) for m in model.modules())
    assert 2 <= cfg.n_mtp_layers <= 4
    return {2: pairs, cfg.n_mtp_layers: 1}


def test_tiny_step_sets_are_grouped_and_the_step_is_unchanged(tiny_step):
    ep = tiny_step.cleaned()
    before = tiny_step.cleaned()
    PassManager(FUSIONS).run(ep, state_inputs=tiny_step.states(ep))
    PassManager(FUSIONS).run(before, state_inputs=tiny_step.states(before))
    linears = _count(ep, LINEAR)
    stats = PassManager(["group_fp8_linears"], PassConfig(verify=True, verify_seeds=1)).run(
        ep, input_factory=tiny_step.inputs, state_inputs=tiny_step.states(ep))
    assert stats[0]["verified"]
    sets = stats[0]["notes"]["nodes_by_size"]
    assert sets == _expected_sets(tiny_step.model, tiny_step.cfg), sets
    assert _count(ep, MULTI) == sum(sets.values())
    assert _count(ep, LINEAR) == linears - sum(k * n for k, n in sets.items())
    tiny_step.lib.assert_same_run(tiny_step.run(before, 5), tiny_step.run(ep, 5))


def test_default_pipeline_runs_it_after_the_fusions_and_cse():
    from dspark_compile.passes import REGISTRY
    order = [s.name for s in REGISTRY.build_pipeline()]
    assert "group_fp8_linears" in order
    for name in ("fuse_act_quant", "drop_region_markers", "cse"):
        assert order.index(name) < order.index("group_fp8_linears")
    assert REGISTRY["group_fp8_linears"].stage == "fusion"
