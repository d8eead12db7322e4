"""Hand-checked values for the pieces where a transpose or an off-by-one hides easily."""
import torch

from dspark_compile.models.batch import Batch
from dspark_compile.models.config import ModelConfig, Precision
from dspark_compile.models.mhc import HyperConnection
from dspark_compile.models.moe import MoE, Gate
from dspark_compile.factory.presets import preset
from dspark_compile.models.rope import rope_frequencies
from dspark_compile.kernels.sampling.reference import fold_ids


def tiny_cfg():
    return ModelConfig.from_dict(preset("tiny"))


def test_mhc_post_sums_over_the_first_index():
    """X'_j = post_j * y + sum_i C[i, j] X_i — with an asymmetric C the transpose is visible."""
    T, m, D = 1, 4, 3
    X = torch.arange(T * m * D, dtype=torch.float64).view(T, m, D)
    y = torch.ones(T, D, dtype=torch.float64)
    post = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    C = torch.zeros(T, m, m, dtype=torch.float64)
    C[0, 0, 1] = 1.0   # stream 0 feeds stream 1 (i=0 -> j=1)
    C[0, 2, 3] = 0.5   # stream 2 feeds stream 3 at half weight
    out = HyperConnection.post(y, X, post, C)
    expect = torch.stack([post[0, 0] * y[0],
                          post[0, 1] * y[0] + X[0, 0],
                          post[0, 2] * y[0],
                          post[0, 3] * y[0] + 0.5 * X[0, 2]])
    torch.testing.assert_close(out[0], expect)


def test_mhc_pre_sinkhorn_is_doubly_stochastic():
    cfg = tiny_cfg()
    hc = HyperConnection(cfg).double()
    g = torch.Generator().manual_seed(0)
    hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 0.1)
    hc.base.copy_(torch.randn(hc.base.shape, generator=g))
    hc.scale.copy_(torch.tensor([1.0, 1.0, 2.0]))
    X = torch.randn(5, cfg.hc_mult, cfg.hidden_size, generator=g, dtype=torch.float64)
    a, post, C = hc.pre(X)
    # independent loop: softmax + eps, one column pass, then 19 (row, column) pairs
    xf = X.flatten(1)
    mu = (xf @ hc.fn.T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    for t in range(5):
        c = torch.softmax((mu[t, 8:] * 2.0 + hc.base[8:]).view(4, 4), -1) + cfg.hc_eps
        for k in range(cfg.hc_sinkhorn_iters):
            if k:
                c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)
            c = c / (c.sum(0, keepdim=True) + cfg.hc_eps)
        torch.testing.assert_close(C[t], c, rtol=1e-12, atol=1e-12)
    # the last pass normalises columns: each sums to 1 up to the eps in its denominator
    torch.testing.assert_close(C.sum(-2), torch.ones(5, 4, dtype=torch.float64), atol=1e-5, rtol=0)
    assert ((post > 0) & (post < 2)).all()
    assert a.shape == (5, cfg.hidden_size)


def test_hash_routing_uses_tid2eid_and_unbiased_scores():
    cfg = tiny_cfg()
    gate = Gate(cfg, hash_layer=True).double()
    g = torch.Generator().manual_seed(1)
    gate.weight.copy_(torch.randn(gate.weight.shape, generator=g).to(gate.weight.dtype))
    gate.tid2eid.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:2]
                                    for _ in range(cfg.vocab_size)]))
    x = torch.randn(3, cfg.hidden_size, generator=g, dtype=torch.float64)
    tokens = torch.tensor([5, 17, cfg.vocab_size - 1])
    idx, w = gate(x, tokens)
    assert torch.equal(idx, gate.tid2eid[tokens])
    logits = x @ gate.weight.double().T
    score = torch.sqrt(torch.nn.functional.softplus(logits))
    sel = score.gather(-1, idx)
    torch.testing.assert_close(w, sel / sel.sum(-1, keepdim=True) * cfg.routed_scaling_factor)


def test_bias_routing_selects_with_bias_but_weights_without():
    cfg = tiny_cfg()
    gate = Gate(cfg, hash_layer=False).double()
    gate.weight.zero_()
    gate.bias.copy_(torch.arange(cfg.n_routed_experts, dtype=torch.float64))  # bias favours the last
    x = torch.randn(2, cfg.hidden_size, dtype=torch.float64)
    idx, w = gate(x, torch.tensor([0, 1]))
    assert set(idx[0].tolist()) == {cfg.n_routed_experts - 1, cfg.n_routed_experts - 2}
    # all scores are sqrt(softplus(0)): equal weights after renormalisation
    torch.testing.assert_close(w, torch.full_like(w, cfg.routed_scaling_factor / cfg.num_experts_per_tok))


def test_moe_returns_the_compute_dtype():
    """The routed experts sum in fp32; the layer's output is the residual stream's dtype (bf16
    here): mHC's post takes y in the stream's dtype, and its GPU kernel refuses anything else."""
    cfg = tiny_cfg()
    moe = MoE(cfg, hash_layer=False, prec=Precision(dtype=torch.bfloat16, act_quant=False))
    g = torch.Generator().manual_seed(3)
    for name, buf in moe.named_buffers():
        if buf.dtype == torch.float8_e4m3fn:
            buf.copy_((torch.randn(buf.shape, generator=g) * 0.1).to(buf.dtype))
        elif buf.is_floating_point():
            buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype) * 0.1)
        elif buf.dtype == torch.uint8:
            buf.copy_(torch.randint(118, 126, buf.shape, generator=g, dtype=torch.uint8))
    x = torch.randn(4, cfg.hidden_size, generator=g).to(torch.bfloat16)
    y = moe(x, None, torch.arange(4))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape and bool(torch.isfinite(y).all())


def test_out_of_range_ids_never_reach_a_gather():
    V = 512
    ids = torch.tensor([[-1, 0, V - 1, V, 10 ** 9]])
    assert fold_ids(ids, V).tolist() == [[0, 0, V - 1, 0, 0]]
    b = Batch.make(torch.tensor([0]), torch.arange(5)[None], ids, trash=1, vocab=V)
    assert b.tokens.min() >= 0 and b.tokens.max() < V


def test_yarn_only_blends_the_middle_pairs():
    cfg = tiny_cfg()
    plain = rope_frequencies(cfg.rope_main, 64)
    comp = rope_frequencies(cfg.rope_compress, 64)
    base = cfg.rope_compress.theta ** (-torch.arange(32, dtype=torch.float64) * 2 / 64)
    assert torch.allclose(plain, 10000.0 ** (-torch.arange(32, dtype=torch.float64) * 2 / 64))
    assert torch.allclose(comp[0], base[0])                             # high frequencies kept
    assert torch.allclose(comp[-1], base[-1] / cfg.rope_compress.factor)  # low ones divided
    assert ((comp <= base + 1e-18) & (comp >= base / cfg.rope_compress.factor - 1e-18)).all()


def test_ring_slots_name_each_slot_once_with_what_sequential_writes_leave():
    """A row writing more positions than the ring holds (a 12-token prefill chunk into an 8-slot
    ring) keeps only its newest `ring` positions: no slot is named twice (a CUDA index_put_
    with repeated indices has no defined winner), and the ring ends as in-order writes leave it.
    Padded rows and masked positions write nothing."""
    from dspark_compile.kernels.common import masked_row_write
    ring, trash = 8, 3
    pos = torch.stack([torch.arange(12), torch.arange(5, 17), torch.arange(12), torch.arange(12)])
    rows = torch.tensor([0, 1, trash, 2])
    write = torch.ones(4, 12, dtype=torch.bool)
    write[3, 9:] = False                       # row 2 writes positions 0..8 only
    batch = Batch(rows=rows, pos=pos, tokens=torch.zeros_like(pos), valid=rows < trash)
    slots = batch.ring_slots(ring, write).view(4, 12)
    for b in range(4):
        named = slots[b][slots[b] >= 0]
        assert named.unique().numel() == named.numel(), f"row {b} names a slot twice: {slots[b]}"
    assert (slots[2] == -1).all(), "the padded row wrote"
    values = pos.float() + 1                   # what each position writes
    dst = torch.zeros((trash + 1) * ring + 1)
    masked_row_write(dst, slots.reshape(-1), values.reshape(-1))
    seq = torch.zeros_like(dst)
    for b in range(4):
        for t in range(12):
            if rows[b] < trash and write[b, t]:
                seq[rows[b] * ring + pos[b, t] % ring] = values[b, t]
    torch.testing.assert_close(dst[:-1], seq[:-1], rtol=0, atol=0)
