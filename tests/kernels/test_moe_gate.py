"""`dspark::moe_gate` (kernels/moe_gate.py), the router after its logits, against its reference.

Without CUDA the launcher runs the Triton kernel in the CPU interpreter (tests/conftest.py).
What must hold, on fresh random logits at irregular expert counts, on top-k and hash layers:
- the selected experts equal the reference's, in its order (no ties in random logits);
- the weights are within a few fp32 ulps (softplus by another formula), and sum to `scale`
  when normalised;
- ties go to the lower expert id, a NaN score is selected first, ±inf logits and tokens out of
  the vocabulary behave as documented;
- the op exports as one node, its CPU dispatch is the reference, bad inputs are named.
"""
import pytest
import torch

from dspark_compile.kernels import moe_gate as mg

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 256, 6), (9, 72, 6), (5, 16, 1), (33, 40, 8), (4, 8, 8)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(T, E, k, hash_layer, seed, vocab=100):
    g = _gen(seed)
    logits = torch.randn(T, E, generator=g) * 3
    bias = None if hash_layer else torch.randn(E, generator=g) * 0.2
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(vocab)]) \
        if hash_layer else None
    tokens = torch.randint(0, vocab, (T,), generator=g)
    return logits, bias, tid2eid, tokens


def _run(logits, bias, tid2eid, tokens, k, norm=True, scale=2.5):
    dev = lambda t: None if t is None else t.to(DEV)
    idx, w = mg.moe_gate_launch(dev(logits), dev(bias), dev(tid2eid), dev(tokens), k, norm, scale)
    return idx.cpu(), w.cpu()


@pytest.mark.parametrize("T,E,k", SHAPES)
@pytest.mark.parametrize("hash_layer", [False, True])
@pytest.mark.parametrize("norm", [True, False])
def test_moe_gate_matches_reference(T, E, k, hash_layer, norm):
    args = _inputs(T, E, k, hash_layer, seed=T * 7 + E + k + hash_layer)
    idx, w = _run(*args, k, norm)
    ridx, rw = mg.moe_gate_reference(*args, k, norm, 2.5)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == (T, k)
    assert torch.equal(idx, ridx)
    assert not torch.isnan(w).any()
    assert torch.allclose(w, rw, rtol=4e-7 * k, atol=0)
    if norm:
        assert torch.allclose(w.sum(-1), torch.full((T,), 2.5), rtol=1e-5, atol=0)


def test_softplus_tails_and_infinities():
    """Very negative logits (softplus ~ e^x: log1p, not log(1 + e^x)), above 20 (x itself), ±inf."""
    logits = torch.tensor([[-40.0, -17.0, -3.0, 0.0, 1e-3, 19.9, 20.1, 60.0],
                           [-float("inf"), -1.0, 0.5, float("inf"), 2.0, -2.0, 3.0, -60.0]])
    bias = torch.zeros(8)
    idx, w = _run(logits, bias, None, torch.zeros(2, dtype=torch.long), 8, norm=False, scale=1.0)
    ridx, rw = mg.moe_gate_reference(logits, bias, None, torch.zeros(2, dtype=torch.long), 8,
                                     False, 1.0)
    assert torch.equal(idx, ridx)
    assert torch.equal(torch.isinf(w), torch.isinf(rw))
    fin = torch.isfinite(rw)
    assert torch.allclose(w[fin], rw[fin], rtol=4e-7, atol=0)


def test_ties_go_to_the_lower_expert_and_nan_first():
    E, k = 12, 4
    logits = torch.zeros(3, E)
    logits[0, [2, 5, 9]] = 1.0                        # three equal maxima, then zeros
    logits[1, 7] = float("nan")                       # a NaN score: selected first
    logits[1, 3] = 5.0
    logits[2] = 0.25                                  # all equal
    idx, w = _run(logits, torch.zeros(E), None, torch.zeros(3, dtype=torch.long), k, norm=False)
    assert idx[0].tolist() == [2, 5, 9, 0]
    assert idx[1, :2].tolist() == [7, 3] and idx[1, 2:].tolist() == [0, 1]
    assert torch.isnan(w[1, 0]) and not torch.isnan(w[1, 1:]).any()
    assert idx[2].tolist() == [0, 1, 2, 3]


def test_bias_selects_but_does_not_weigh():
    E, k = 16, 2
    logits = torch.linspace(-1, 1, E)[None, :].clone()
    bias = torch.zeros(E)
    bias[0] = bias[1] = 100.0                         # the two lowest scores win selection
    idx, w = _run(logits, bias, None, torch.zeros(1, dtype=torch.long), k, norm=False, scale=1.0)
    assert idx[0].tolist() == [1, 0]                  # expert 1's score is the higher one
    score = torch.sqrt(torch.nn.functional.softplus(logits[0, [1, 0]]))
    assert torch.allclose(w[0], score, rtol=1e-6, atol=0)


def test_hash_layer_folds_out_of_range_tokens():
    logits, _, tid2eid, _ = _inputs(4, 32, 6, True, seed=3, vocab=50)
    tokens = torch.tensor([-1, 50, 10**9, 7])
    idx, _ = _run(logits, None, tid2eid, tokens, 6)
    assert torch.equal(idx[:3], tid2eid[0].expand(3, -1))       # folded to id 0
    assert torch.equal(idx[3], tid2eid[7])
    assert torch.equal(idx, mg.moe_gate_reference(logits, None, tid2eid, tokens, 6, True, 2.5)[0])


def test_a_row_does_not_depend_on_its_batch():
    logits, bias, _, tokens = _inputs(24, 72, 6, False, seed=21)
    full = _run(logits, bias, None, tokens, 6)
    for j in (0, 11, 23):
        one = _run(logits[j:j + 1], bias, None, tokens[j:j + 1], 6)
        assert torch.equal(one[0][0], full[0][j]) and torch.equal(one[1][0], full[1][j])


def test_no_tokens():
    idx, w = mg.moe_gate_launch(torch.zeros(0, 16), torch.zeros(16), None,
                                torch.zeros(0, dtype=torch.long), 4, True, 1.0)
    assert idx.shape == (0, 4) and w.shape == (0, 4)


def test_registered_op_on_cpu_is_reference_and_exports():
    logits, bias, _, tokens = _inputs(6, 40, 6, False, seed=5)
    out = torch.ops.dspark.moe_gate(logits, bias, None, tokens, 6, True, 2.5)
    ref = mg.moe_gate_reference(logits, bias, None, tokens, 6, True, 2.5)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])

    class M(torch.nn.Module):
        def forward(self, logits, bias, tokens):
            return torch.ops.dspark.moe_gate(logits, bias, None, tokens, 6, True, 2.5)

    ep = torch.export.export(M(), (logits, bias, tokens), strict=False)
    assert sum(n.target == torch.ops.dspark.moe_gate.default for n in ep.graph.nodes) == 1
    got = ep.module()(logits, bias, tokens)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_bad_inputs_name_the_argument():
    logits, bias, tid2eid, tokens = _inputs(3, 16, 4, True, seed=7)
    with pytest.raises(ValueError, match="exactly one of bias"):
        mg.moe_gate_launch(logits, torch.zeros(16), tid2eid, tokens, 4, True, 1.0)
    with pytest.raises(ValueError, match="tid2eid"):
        mg.moe_gate_launch(logits, None, tid2eid[:, :3], tokens, 4, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        mg.moe_gate_launch(logits, torch.zeros(15), None, tokens, 4, True, 1.0)
    with pytest.raises(ValueError, match="tokens"):
        mg.moe_gate_launch(logits, torch.zeros(16), None, tokens[:2], 4, True, 1.0)
    with pytest.raises(ValueError, match="k=17"):
        mg.moe_gate_launch(logits, torch.zeros(16), None, tokens, 17, True, 1.0)
    with pytest.raises(ValueError, match="logits"):
        mg.moe_gate_launch(logits.bfloat16(), torch.zeros(16), None, tokens, 4, True, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [6, 384])
@pytest.mark.parametrize("hash_layer", [False, True])
def test_gpu_flash_dims_in_a_cuda_graph(T, hash_layer):
    """256 experts, top-6, replayed in a CUDA graph with new logits: equal to the eager launch
    and to the reference's selection."""
    logits, bias, tid2eid, tokens = _inputs(T, 256, 6, hash_layer, seed=T, vocab=1000)
    ridx, rw = mg.moe_gate_reference(logits, bias, tid2eid, tokens, 6, True, 2.5)
    dev = lambda t: None if t is None else t.cuda()
    lg, b, tt, tk = dev(logits), dev(bias), dev(tid2eid), dev(tokens)
    idx, w = mg.moe_gate_launch(lg, b, tt, tk, 6, True, 2.5)
    assert torch.equal(idx.cpu(), ridx) and torch.allclose(w.cpu(), rw, rtol=3e-6, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mg.moe_gate_launch(lg, b, tt, tk, 6, True, 2.5)
    lg.copy_(torch.randn(T, 256, generator=_gen(T + 1)).cuda() * 3)
    graph.replay()
    torch.cuda.synchronize()
    again = mg.moe_gate_launch(lg, b, tt, tk, 6, True, 2.5)
    assert torch.equal(out[0], again[0]) and torch.equal(out[1], again[1])
