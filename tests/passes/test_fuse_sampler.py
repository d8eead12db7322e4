"""fuse_sampler: the step's Markov sampler and rejection sampling regions become one dspark:: op
each (and plain sampling, in a program that has it); the step is unchanged, including every
sampled token and the draft logits it stores."""
import warnings

import pytest
import torch

from dspark_compile.kernels.sampling.reference import sample_reference
from dspark_compile.passes import PassManager, PassNoMatchWarning

OPS = ("markov_sample", "rejection_sample", "sample")


def test_counts_and_pattern_gone(tiny_step):
    lib, ep = tiny_step.lib, tiny_step.cleaned()
    expected = {"markov_sample": 1, "rejection_sample": 1, "sample": 0}
    assert {o: tiny_step.expected[o] for o in OPS} == expected
    assert lib.region_counts(ep, OPS) == expected
    nodes_before = len(ep.graph_module.graph.nodes)

    stats = PassManager(["fuse_sampler"]).run(ep, state_inputs=tiny_step.states(ep))
    assert stats[0]["matches"] == 2
    assert stats[0]["notes"] == {"fused": expected, "skipped": []}
    assert lib.op_counts(ep, OPS) == expected
    assert lib.annotated_nodes(ep, OPS) == []
    # the unrolled N-step sampler and the rejection graph were most of the step's nodes
    assert nodes_before - len(ep.graph_module.graph.nodes) > 1000
    # the stateful RNG is not used anywhere: the ops draw Philox noise from (seed, position)
    assert not any(n.target in (torch.ops.aten.rand.default, torch.ops.aten.randn.default)
                   for n in ep.graph_module.graph.nodes)


def test_step_numerics_unchanged(tiny_step):
    before = tiny_step.cleaned()
    after = tiny_step.cleaned()
    PassManager(["fuse_sampler"]).run(after, state_inputs=tiny_step.states(after))
    # seeds give mixed greedy / temperature / top-k / top-p rows (prefilled_state)
    for seed in (7, 8):
        tiny_step.lib.assert_same_run(tiny_step.run(before, seed), tiny_step.run(after, seed))


class _Sampler(torch.nn.Module):
    def forward(self, logits, temperature, top_k, top_p, seed, position):
        return sample_reference(logits * 2.0, temperature, top_k, top_p, seed, position) + 1


def _sampler_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    B, V = 3, 64
    return (torch.randn(B, V, generator=g), torch.tensor([0.0, 0.7, 1.0]),
            torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.9]),
            torch.randint(0, 1 << 30, (B,), generator=g), torch.randint(0, 100, (B,), generator=g))


def test_plain_sample_region():
    with torch.fx.traceback.preserve_node_meta():
        ep = torch.export.export(_Sampler(), _sampler_inputs(0), strict=False)
    stats = PassManager(["remove_asserts", "remove_noops", "dce", "fuse_sampler"]).run(ep)
    assert stats[-1]["notes"]["fused"] == {"markov_sample": 0, "rejection_sample": 0, "sample": 1}
    ops = [n.target for n in ep.graph_module.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten.mul.Tensor, torch.ops.dspark.sample.default,
                   torch.ops.aten.add.Tensor]
    for s in (1, 2):
        torch.testing.assert_close(ep.module()(*_sampler_inputs(s)),
                                   _Sampler()(*_sampler_inputs(s)), rtol=0, atol=0)


def test_no_region_warns(toy_export):
    _, ep = toy_export           # a step without any fusable region
    with pytest.warns(PassNoMatchWarning, match="fuse_sampler"):
        PassManager(["fuse_sampler"]).run(ep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PassManager(["drop_region_markers"]).run(ep)
