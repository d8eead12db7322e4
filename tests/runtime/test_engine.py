"""Runtime generate == eager reference generate, token for token (CPU, float64, no graphs).

The reference is `models.generate.generate(..., speculative=True)` on a model loaded
independently from the checkpoint; the engine runs the compiled, pass-transformed programs
loaded from disk. Covered: greedy and sampled rows (temperature/top-k/top-p, fixed seeds) in one
batch, different prompt lengths / max_new_tokens / stop ids so rows finish at different steps
and later steps run smaller buckets with padded rows, requests finished by their first token,
more requests than state rows (waiting queue, rows reused), more live rows than the largest
bucket (each step split across program calls), and the lossless check on the engine output.
"""
import dataclasses
import random

import pytest
import torch

from dspark_compile.engine_dir.format import STEP, TARGET, ProgramKey
from dspark_compile.runtime.lossless import END, check_lossless, greedy_reference
from dspark_compile.models.generate import generate
from dspark_compile.models.request import SamplingParams
from dspark_compile.models.state import restore_state, snapshot_state
from dspark_compile.runtime.engine import StepTimes


def _prompts(rng, V, lengths):
    return [[rng.randrange(V) for _ in range(n)] for n in lengths]


def _run(eng, prompts, params):
    eng.times = StepTimes()
    return eng.generate(prompts, params)


def _assert_same(res, ref, prompts):
    for i, (a, b) in enumerate(zip(res.tokens, ref.tokens)):
        assert a == b, f"request {i} (prompt length {len(prompts[i])}): engine {a} != reference {b}"


@pytest.fixture(scope="module")
def greedy_run(default_loaded, ref_model):
    """Six greedy requests of mixed lengths, one ended by its first token (max_new_tokens=1),
    one by a stop id it reaches after a few tokens."""
    rng = random.Random(1)
    V = ref_model.cfg.vocab_size
    prompts = _prompts(rng, V, [1, 3, 17, 40, 9, 25])
    new = [1, 12, 25, 6, 18, 30]
    params = [SamplingParams(max_new_tokens=n) for n in new]
    stop = greedy_reference(ref_model, prompts[4], 5)[0][4]
    params[4] = SamplingParams(max_new_tokens=new[4], stop_ids=(stop,))
    res = _run(default_loaded, prompts, params)
    times = default_loaded.times
    ref = generate(ref_model, prompts, params, speculative=True)
    return prompts, params, res, ref, times


def test_greedy_mixed_batch_equals_reference(greedy_run):
    prompts, params, res, ref, times = greedy_run
    _assert_same(res, ref, prompts)
    assert len(res.tokens[0]) == 1
    assert res.tokens[4][-1] in params[4].stop_ids and len(res.tokens[4]) <= 5
    assert [len(t) for i, t in enumerate(res.tokens) if i not in (0, 4)] == \
        [p.max_new_tokens for i, p in enumerate(params) if i not in (0, 4)]
    # same step accounting as the reference: steps, accepted drafts per position
    assert (res.steps, res.row_steps, res.accepted_at) == \
        (ref.steps, ref.row_steps, ref.accepted_at)
    assert sum(res.accepted_at) > 0, "no draft accepted: the accept paths were not exercised"
    # rows finished at different steps: later steps ran smaller buckets, padded
    assert len(times.per_bucket) >= 3, times.per_bucket
    assert times.steps == res.steps
    # every row greedy: every step ran the greedy draft-sampler variant
    assert times.greedy_steps == times.steps


def test_greedy_engine_is_lossless(greedy_run, default_loaded, ref_model):
    prompts, params, res, _, _ = greedy_run
    report = check_lossless(default_loaded.model, prompts, params, res.tokens)
    assert report.ok, report.line()
    plain = generate(ref_model, prompts, params, speculative=False)
    assert res.tokens == plain.tokens


def test_lossless_check_catches_wrong_outputs(greedy_run, ref_model):
    prompts, params, res, _, _ = greedy_run
    i = 2   # 25 tokens, no stop id
    p, sp, out = [prompts[i]], [params[i]], res.tokens[i]
    flipped = list(out)
    flipped[7] = (flipped[7] + 1) % ref_model.cfg.vocab_size
    r = check_lossless(ref_model, p, sp, [flipped])
    assert not r.ok and (r.index, r.expected, r.got) == (7, out[7], flipped[7]) and r.margin > 0
    assert r.top1 != 0 and r.relative_margin > 0 and "DIVERGED at request 0, token 7" in r.line()
    r = check_lossless(ref_model, p, sp, [out[:-3]])            # ended too early
    assert not r.ok and (r.index, r.got) == (len(out) - 3, END) and "output ended" in r.line()
    j = 4   # stop id: the reference ends there, an output running on is wrong
    r = check_lossless(ref_model, [prompts[j]], [params[j]], [res.tokens[j] + [0]])
    assert not r.ok and r.expected == END and r.relative_margin == float("inf")
    with pytest.raises(ValueError, match="greedy"):
        check_lossless(ref_model, p, [SamplingParams(temperature=0.7)], [out])


def test_sampled_rows_equal_reference_and_reproduce(default_loaded, ref_model):
    rng = random.Random(2)
    V = ref_model.cfg.vocab_size
    prompts = _prompts(rng, V, [5, 12, 2, 30, 8])
    settings = [(0.8, 0, 1.0), (1.0, 5, 1.0), (0.0, 0, 1.0), (0.7, 0, 0.9), (1.2, 20, 0.8)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=100 + i,
                             max_new_tokens=rng.randint(8, 20))
              for i, (t, k, p) in enumerate(settings)]
    res = _run(default_loaded, prompts, params)
    ref = generate(ref_model, prompts, params, speculative=True)
    _assert_same(res, ref, prompts)
    again = _run(default_loaded, prompts, params)
    assert again.tokens == res.tokens, "same seeds must give the same tokens"
    reseeded = [SamplingParams(**{**p.__dict__, "seed": p.seed + 1000}) for p in params]
    other = _run(default_loaded, prompts, reseeded)
    sampled = [i for i, (t, _, _) in enumerate(settings) if t > 0]
    assert any(other.tokens[i] != res.tokens[i] for i in sampled), "seeds have no effect"
    assert other.tokens[2] == res.tokens[2], "a greedy row does not depend on its seed"


def test_sampled_request_does_not_depend_on_its_batch(default_loaded, ref_model):
    """A sampled request's tokens, at a fixed seed, are the same alone (bucket 1), at every
    position of a batch of 3 (bucket 4, one padded row) and inside a batch of 9 (bucket 16):
    its draws are keyed by seed and position, never by row, and its logits by its own tokens."""
    rng = random.Random(5)
    V = ref_model.cfg.vocab_size
    prompt = _prompts(rng, V, [11])[0]
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_new_tokens=16)
    alone = _run(default_loaded, [prompt], [mine]).tokens[0]
    others = _prompts(rng, V, [4, 23, 7, 1, 30, 9, 15, 2])
    other_params = [SamplingParams(temperature=[0.0, 1.1, 0.7][i % 3], top_k=5 * (i % 2),
                                   seed=i, max_new_tokens=rng.randint(3, 20))
                    for i in range(len(others))]
    batches = [(others[:2], other_params[:2], pos) for pos in range(3)]
    batches.append((others, other_params, 5))
    for companions, params, pos in batches:
        prompts = companions[:pos] + [prompt] + companions[pos:]
        batch_params = params[:pos] + [mine] + params[pos:]
        got = _run(default_loaded, prompts, batch_params).tokens[pos]
        assert got == alone, (f"at position {pos} of {len(prompts)}: {got} != alone {alone}")
    assert len(set(alone)) > 1, "the request does not sample: the check proves little"


def test_requests_finished_by_their_first_token(small_loaded, ref_model):
    # nothing is left to decode after prefill: no step runs, the rows are free again
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6], [7]]
    firsts = [greedy_reference(ref_model, p, 1)[0][0] for p in prompts]
    params = [SamplingParams(max_new_tokens=1),
              SamplingParams(max_new_tokens=9, stop_ids=(firsts[1],)),
              SamplingParams(max_new_tokens=1, temperature=0.9, seed=3)]
    res = _run(small_loaded, prompts, params)
    ref = generate(ref_model, prompts, params, speculative=True)
    _assert_same(res, ref, prompts)
    assert res.tokens[:2] == [[firsts[0]], [firsts[1]]] and len(res.tokens[2]) == 1
    assert res.steps == 0 and small_loaded.times.steps == 0


def test_more_requests_than_rows_wait_and_reuse_rows(small_loaded, ref_model):
    # max_rows 5: the three short requests wait until long ones finish and then run in rows
    # that still hold a previous request's caches, compressor state and draft context
    assert small_loaded.cache.max_rows == 5
    rng = random.Random(3)
    V = ref_model.cfg.vocab_size
    prompts = _prompts(rng, V, [45, 38, 50, 30, 41, 2, 1, 4])
    new = [6, 24, 30, 12, 20, 10, 12, 8]
    params = [SamplingParams(max_new_tokens=n) for n in new]
    params[6] = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=11)
    res = _run(small_loaded, prompts, params)
    ref = generate(ref_model, prompts, params, speculative=True)
    _assert_same(res, ref, prompts)
    assert [len(t) for t in res.tokens] == new


def test_batch_larger_than_the_largest_bucket(small_loaded, ref_model):
    # 5 live rows, largest bucket 2: every step runs as 2 + 2 + 1 program calls
    rng = random.Random(4)
    V = ref_model.cfg.vocab_size
    prompts = _prompts(rng, V, [7, 19, 3, 26, 11])
    params = [SamplingParams(max_new_tokens=n) for n in (14, 9, 16, 12, 10)]
    params[1] = SamplingParams(max_new_tokens=9, temperature=1.0, top_k=8, seed=5)
    res = _run(small_loaded, prompts, params)
    ref = generate(ref_model, prompts, params, speculative=True)
    _assert_same(res, ref, prompts)
    times = small_loaded.times
    # 5 live rows over buckets of at most 2: the first step alone takes 3 calls (2 + 2 + 1),
    # both programs ran, and the calls carried every live row of every step (a call holds at
    # most 2). How many calls the later steps take depends on when rows finish (sampled rows:
    # on the noise), so no tighter count is asserted.
    assert set(times.per_bucket) == {1, 2}, times
    assert times.steps >= res.steps + 2, times
    assert 2 * times.per_bucket[2] + times.per_bucket[1] >= res.row_steps, (times, res.row_steps)
    assert (res.steps, res.accepted_at) == (ref.steps, ref.accepted_at)


def test_target_only_decoding_equals_the_reference_and_the_speculative_output(small_loaded,
                                                                              ref_model):
    """generate(speculative=False) runs the target-only programs: the eager reference's
    non-speculative tokens (greedy and sampled rows, stop ids, more requests than rows, more
    live rows than the largest bucket), one token per row and step, no acceptance counted; and
    greedy speculative decoding of the same requests gives the same tokens (float64)."""
    from dspark_compile.runtime.lossless import compare_outputs
    rng = random.Random(7)
    V = ref_model.cfg.vocab_size
    prompts = _prompts(rng, V, [7, 19, 3, 26, 11, 2, 30])
    new = [14, 9, 16, 12, 10, 5, 8]
    params = [SamplingParams(max_new_tokens=n) for n in new]
    params[1] = SamplingParams(max_new_tokens=9, temperature=1.0, top_k=8, seed=5)
    params[5] = SamplingParams(max_new_tokens=5, temperature=0.8, top_p=0.9, seed=-2)
    stop = greedy_reference(ref_model, prompts[3], 6)[0][5]
    params[3] = SamplingParams(max_new_tokens=12, stop_ids=(stop,))
    small_loaded.times = StepTimes()
    res = small_loaded.generate(prompts, params, speculative=False)
    ref = generate(ref_model, prompts, params, speculative=False)
    _assert_same(res, ref, prompts)
    times = small_loaded.times
    assert times.target_steps == times.steps > 0 and times.greedy_steps == 0
    assert res.row_steps == 0 and res.accepted_at == [0] * ref_model.cfg.dspark_block_size
    greedy = [i for i, sp in enumerate(params) if sp.temperature <= 0]
    spec = _run(small_loaded, [prompts[i] for i in greedy], [params[i] for i in greedy])
    assert compare_outputs([res.tokens[i] for i in greedy], spec.tokens).ok


def test_run_step_without_speculation(small_loaded, ref_model):
    """One target-only step: tokens [n, 1], num 1 per live row and 0 for the trash row."""
    state = snapshot_state(small_loaded.state)
    try:
        out, num = small_loaded.run_step([0, small_loaded.trash], speculative=False)
        assert tuple(out.shape) == (2, 1) and num.tolist() == [1, 0] and int(out[1, 0]) == -1
    finally:
        restore_state(small_loaded.state, state)


def test_target_only_decoding_needs_the_programs(default_loaded):
    """default_loaded is built with BuildConfig's default, no target programs: a clear error
    naming the build flag, before anything runs."""
    with pytest.raises(ValueError, match="built with --no-target-programs"):
        default_loaded.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3), speculative=False)
    with pytest.raises(ValueError, match="built with --no-target-programs"):
        default_loaded.run_step([0], speculative=False)


def test_padding_and_bucket_choice_do_not_change_a_step(default_loaded):
    """The same state copy run as rows [7, 3] in bucket 2 and as [7, trash, 3] in bucket 4:
    the live rows' outputs and state agree, and no row outside them changes (padding is
    inert) except the trash row."""
    eng = default_loaded
    from dspark_compile.models.generate import set_row_sampling
    from dspark_compile.models.step import prefill
    for row, prompt, sp in ((7, [5, 6, 7, 8, 9, 10], SamplingParams()),
                            (3, [42, 17], SamplingParams(temperature=0.9, seed=1))):
        set_row_sampling(eng.state, row, sp)
        prefill(eng.model, eng.state, row, prompt, eng.cache.max_step_tokens, speculative=True)
    snap = snapshot_state(eng.state)
    t2, n2 = eng.run_step([7, 3])
    after2 = snapshot_state(eng.state)
    restore_state(eng.state, snap)
    t4, n4 = eng.run_step([7, eng.trash, 3], bucket=4)
    assert n4[1] == 0 and (t4[1] == -1).all(), "a padded row emitted tokens"
    assert torch.equal(t2, t4[[0, 2]]) and torch.equal(n2, n4[[0, 2]])
    keep = torch.ones(eng.trash + 1, dtype=torch.bool)
    keep[[3, 7, eng.trash]] = False
    for k, v in eng.state.items():
        assert torch.equal(v[keep], snap[k][keep]), f"state '{k}': a row outside the batch changed"
        torch.testing.assert_close(v[[3, 7]], after2[k][[3, 7]], msg=f"state '{k}'")


def test_greedy_variant_equals_the_full_program(default_loaded):
    """The greedy variant of a bucket (dspark_compile/runtime/variants.py) shares the program's weights,
    differs only in the samplers' modes (Markov and rejection) and the dropped store of the draft
    logits, and on greedy rows computes the same step as the full program, whole state included
    but for the greedy rows' draft logits (never read: the full program stores them, the variant
    leaves what was there); it is refused for a batch with a sampled row and picked only without
    one."""
    from dspark_compile.models.generate import set_row_sampling
    from dspark_compile.models.step import prefill
    import operator
    from dspark_compile.runtime.variants import _mode_arg, markov_nodes, rejection_nodes

    def modes(nodes):
        return [n.args[_mode_arg(n.target)] if len(n.args) > _mode_arg(n.target)
                else n.kwargs.get("mode", "full") for n in nodes]

    def sampler_modes(gm):
        return modes(markov_nodes(gm)) + modes(rejection_nodes(gm))

    def state_writes_of_probs(gm):
        return sum(1 for n in markov_nodes(gm) for g in n.users
                   if g.target is operator.getitem and g.args[1] == 1
                   for u in g.users if u.target is torch.ops.aten.index_put_.default)
    eng = default_loaded
    b = 4
    full = eng.program(ProgramKey(STEP, b)).fn
    greedy = eng.program(ProgramKey(STEP, b, "greedy")).fn
    assert sampler_modes(full) == ["full", "full"]
    assert sampler_modes(greedy) == ["greedy", "greedy"]
    # the greedy plan leaves the draft logits unwritten: the variant does not store them
    assert state_writes_of_probs(full) == 1 and state_writes_of_probs(greedy) == 0
    fp = dict(full.named_buffers())
    assert all(v.data_ptr() == fp[k].data_ptr() for k, v in greedy.named_buffers()), \
        "the variant copied weights"
    for row, prompt in ((9, [3, 1, 4, 1, 5]), (12, [2, 7])):
        set_row_sampling(eng.state, row, SamplingParams())
        prefill(eng.model, eng.state, row, prompt, eng.cache.max_step_tokens, speculative=True)
    snap = snapshot_state(eng.state)
    outs = {}
    for variant in ("full", "greedy"):
        restore_state(eng.state, snap)
        eng.times = StepTimes()
        outs[variant] = (*eng.run_step([9, 12], bucket=b, variant=variant),
                         {k: v[:eng.trash].clone() for k, v in eng.state.items()})
        assert eng.times.greedy_steps == (variant == "greedy")
    (tf, nf, sf), (tg, ng, sg) = outs["full"], outs["greedy"]
    assert torch.equal(tf, tg) and torch.equal(nf, ng)
    for k in sf:
        if k == "row.draft_logits":         # the variant left them as they were
            assert torch.equal(sg[k].nan_to_num(7.0), snap[k][:eng.trash].nan_to_num(7.0))
            continue
        assert torch.equal(sf[k], sg[k]), f"state '{k}' differs between the variants"
    # the default picks the greedy variant for these rows, the full program with a sampled row
    restore_state(eng.state, snap)
    eng.times = StepTimes()
    eng.run_step([9, 12], bucket=b)
    assert eng.times.greedy_steps == 1
    set_row_sampling(eng.state, 12, SamplingParams(temperature=0.5, seed=3))
    with pytest.raises(ValueError, match="sampled"):
        eng.run_step([9, 12], bucket=b, variant="greedy")
    eng.run_step([9, 12], bucket=b)
    assert eng.times.greedy_steps == 1
    with pytest.raises(ValueError, match="variant"):
        eng.run_step([9], variant="fast")


def test_the_inductor_greedy_variant_is_the_same_switch(default_loaded):
    """What the Inductor backend compiles for a bucket's greedy variant (compiled.variant_graph,
    on the lifted graph) switches the same calls as the runtime's aten variant: both samplers
    to greedy, the draft logits' store dropped; the full variant is the program's own graph."""
    from dspark_compile.build.inductor import variant_graph, variants_of
    from dspark_compile.runtime.variants import _mode_arg, markov_nodes, rejection_nodes
    ep = default_loaded.programs[1].exported()      # the loaded program traced again
    assert variants_of(ep) == ["full", "greedy"]

    def modes(gm):
        return [n.args[_mode_arg(n.target)] if len(n.args) > _mode_arg(n.target) else "full"
                for n in markov_nodes(gm) + rejection_nodes(gm)]
    full, greedy = variant_graph(ep, "full"), variant_graph(ep, "greedy")
    assert modes(full) == ["full", "full"] and modes(greedy) == ["greedy", "greedy"]
    puts = [n for n in full.graph.nodes if n.target is torch.ops.aten.index_put_.default]
    assert len([n for n in greedy.graph.nodes
                if n.target is torch.ops.aten.index_put_.default]) == len(puts) - 1


@pytest.mark.parametrize("bucket,kernels", [(4, True), (32, False)],
                         ids=["bucket4-kernels", "bucket32-references"])
def test_a_step_reads_no_memory_it_did_not_write(default_loaded, bucket, kernels, monkeypatch):
    """A captured graph runs in a memory pool that holds whatever the last replay, or another
    bucket's graph, left there, so no step may depend on memory it did not write. The same step
    from the same state, run plainly and then with every torch.empty filled (NaN floats, the
    largest ints: torch's fill_uninitialized_memory), must give the same tokens and state: the
    full program on greedy and sampled rows (temperature, top-k, top-p), and the greedy variant
    on greedy rows, each with padded rows in the bucket.

    On the CPU the dspark ops run their references; `kernels` routes them to the Triton
    launchers instead (in the interpreter), so their outputs and scratch are filled too
    (~20 s a step at bucket 4; bucket 32, the samplers' 32-row tiles, takes ~140 s there and
    runs the references). A kernel that reads a buffer it did not zero fails this."""
    from dspark_compile.kernels import registry
    from dspark_compile.models.random_requests import prefill_random_requests
    assert torch.utils.deterministic.fill_uninitialized_memory, "torch's fill is off"
    if kernels:     # registry.dspark_op: the launcher on CUDA tensors, else the reference
        monkeypatch.setattr(registry, "_on_cuda", lambda args, kwargs: True)
    eng = default_loaded
    live = list(range(40, 40 + max(2, bucket * 5 // 8)))       # padding fills the rest
    before = snapshot_state(eng.state)
    # greedy rows at even positions of `live`: the greedy variant below runs live[::2]
    prefill_random_requests(eng.model, eng.state, live, bucket, eng.cache.max_step_tokens,
                            max_prompt_len=20, mix="alternate")
    for variant, rows in (("full", live), ("greedy", live[::2])):
        snap = snapshot_state(eng.state)
        runs = []
        for fill in (False, True):
            restore_state(eng.state, snap)
            was = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(fill)
            try:
                tokens, num = eng.run_step(rows, bucket=bucket, variant=variant)
            finally:
                torch.use_deterministic_algorithms(was)
            runs.append((tokens, num, {k: v[:eng.trash].clone() for k, v in eng.state.items()}))
        (t0, n0, s0), (t1, n1, s1) = runs
        assert torch.equal(t0, t1) and torch.equal(n0, n1), (variant, t0, t1)
        for k in s0:
            torch.testing.assert_close(s1[k], s0[k], rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"{variant}: state '{k}': {m}")
    restore_state(eng.state, before)


def test_a_greedy_variant_that_fails_to_capture_is_dropped(small_loaded, monkeypatch):
    """The greedy variant is an optimisation: if its capture fails (here: faked, CPU has no
    graphs), the load warns, keeps the bucket's full graph and runs all-greedy batches on it."""
    import contextlib
    import copy
    eng = copy.copy(small_loaded)
    eng.table = {k: dataclasses.replace(p) for k, p in small_loaded.table.items()}
    eng.logprob_programs = {k: dataclasses.replace(p)
                            for k, p in small_loaded.logprob_programs.items()}
    eng.capture_seconds, eng.graph_pool_bytes = {}, {}
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda d=None: None)

    def fake_capture(self, fn, b, pool, stream, warmup):
        if fn is small_loaded.program(ProgramKey(STEP, b, "greedy")).fn:
            raise RuntimeError("operation not permitted when stream is capturing")
        return f"graph {b}", 1024
    monkeypatch.setattr(type(eng), "_capture", fake_capture)
    with pytest.warns(UserWarning, match="greedy variant could not be captured"):
        eng._capture_all()
    # the step and the target-only program of each bucket (the CLI-built engine has them);
    # the greedy variants gone
    assert eng.captured() == sorted([ProgramKey(STEP, b) for b in eng.buckets]
                                    + [ProgramKey(TARGET, b) for b in eng.buckets])
    assert all(eng.program(k).graph == f"graph {k.size}" for k in eng.captured())
    assert not any(eng.has(ProgramKey(STEP, b, "greedy")) for b in eng.buckets)
    # the full step's logprobs copy is captured too (runtime/logprobs.py); the greedy one's
    # goes with its program
    assert sorted(eng.logprob_programs) == sorted(ProgramKey(STEP, b) for b in eng.buckets)
    assert eng.graph_pool_bytes == {b: 3 * 1024 for b in eng.buckets}
    assert eng._step_key([0], eng.buckets[0], None) == ProgramKey(STEP, eng.buckets[0])


def test_bad_requests_are_named(small_loaded):
    eng = small_loaded
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.generate([[1] * 100], [SamplingParams(max_new_tokens=100)])
    with pytest.raises(ValueError, match="outside"):
        eng.generate([[1, 10_000]], [SamplingParams()])
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        eng.generate([[1]], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="outside"):
        eng.run_step([eng.trash + 1])
    with pytest.raises(ValueError, match="twice"):
        eng.run_step([1, 1])
    with pytest.raises(ValueError, match="bucket 1"):
        eng.run_step([0, 1], bucket=1)
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        eng.run_step([0, 1, 2])


def test_engine_runs_only_on_the_device_it_was_built_for(small_engine):
    from dspark_compile.runtime.engine import Engine
    with pytest.raises(ValueError, match="was built for cpu, cannot run on cuda"):
        Engine.load(small_engine.path, device="cuda")


def test_backend_defaults_follow_the_device_and_bad_ones_are_named():
    from dspark_compile.engine_dir.build_config import BuildConfig
    assert BuildConfig().backend == "aten"
    assert BuildConfig(device="cuda").backend == "aten"   # Inductor only when asked for
    assert BuildConfig(device="cuda:1", backend="aten").backend == "aten"
    with pytest.raises(ValueError, match="backend must be one of"):
        BuildConfig(backend="tensorrt")


def test_engine_built_with_one_backend_refuses_to_load_as_the_other(small_engine, tmp_path):
    """The manifest records the backend (build_config.backend); a load asking for the other one
    is refused naming that field, and an engine that claims Inductor but lists no compiled
    programs is refused naming the missing field."""
    import shutil

    from dspark_compile.engine_dir.format import ArtifactError
    from dspark_compile.engine_dir.write import update_manifest_field
    from dspark_compile.runtime.engine import Engine
    import copy

    from dspark_compile.engine_dir.fields import engine_configs
    assert small_engine.manifest["build_config"]["backend"] == "aten"
    assert "compiled" not in small_engine.manifest
    older = copy.deepcopy(small_engine.manifest)     # written before the field existed
    del older["build_config"]["backend"]
    assert engine_configs(older)[1].backend == "aten"
    with pytest.raises(ArtifactError, match="'build_config.backend': engine has 'aten', "
                                            "expected 'inductor'") as e:
        Engine.load(small_engine.path, device="cpu", backend="inductor")
    assert e.value.field == "build_config.backend"
    with pytest.raises(ValueError, match="backend must be one of"):
        Engine.load(small_engine.path, device="cpu", backend="onnx")
    claims = tmp_path / "engine"
    shutil.copytree(small_engine.path, claims)
    update_manifest_field(claims, "build_config.backend", "inductor")
    with pytest.raises(ArtifactError, match="engine has 'inductor', expected 'aten'") as e:
        Engine.load(claims, device="cpu", backend="aten")
    assert e.value.field == "build_config.backend"
    with pytest.raises(ArtifactError, match="'compiled.programs' is missing") as e:
        Engine.load(claims, device="cpu", use_graphs=False, trust_code=True)
    assert e.value.field == "compiled.programs"


# ------------------------------------------------------------------ fresh-process round trip
FRESH_STEP = """
import sys, torch
torch.set_num_threads(1)
from dspark_compile.runtime.engine import Engine
eng = Engine.load(sys.argv[1], device="cpu")
case = torch.load(sys.argv[2])
assert sorted(case["state"]) == sorted(eng.state), "state layout differs"
for k, v in eng.state.items():
    v.copy_(case["state"][k])
outs = [eng.run_step(rows, bucket=b) for rows, b in case["calls"]]
torch.save({"outs": outs, "state": eng.state}, sys.argv[3])
print("FRESH-STEP-OK")
"""


def test_engine_step_in_a_fresh_process_equals_in_process(small_loaded, tmp_path):
    """Load the engine from disk in a new interpreter (ops registered by the load itself),
    run the real step on the same state: outputs and the updated state equal the in-process
    run bit for bit."""
    import subprocess
    import sys

    from dspark_compile.models.generate import set_row_sampling
    from dspark_compile.models.step import prefill
    eng = small_loaded
    for row, prompt, sp in ((4, [11, 12, 13, 14], SamplingParams()),
                            (0, [300, 2, 7, 7, 9, 1, 40], SamplingParams(temperature=0.8, top_k=9,
                                                                          seed=21))):
        set_row_sampling(eng.state, row, sp)
        prefill(eng.model, eng.state, row, prompt, eng.cache.max_step_tokens, speculative=True)
    calls = [([4, 0], 2), ([0], 2), ([4], 1)]   # the second call carries a padded row
    torch.save({"state": {k: v.clone() for k, v in eng.state.items()}, "calls": calls},
               tmp_path / "case.pt")
    here = [eng.run_step(rows, bucket=b) for rows, b in calls]
    script = tmp_path / "fresh.py"
    script.write_text(FRESH_STEP)
    r = subprocess.run([sys.executable, str(script), str(eng.dir), str(tmp_path / "case.pt"),
                        str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0 and "FRESH-STEP-OK" in r.stdout, r.stderr[-3000:]
    fresh = torch.load(tmp_path / "out.pt")
    for (t1, n1), (t2, n2) in zip(here, fresh["outs"]):
        assert torch.equal(t1, t2) and torch.equal(n1, n2), (t1, t2, n1, n2)
    assert here[1][1].tolist() != [0] and here[0][1].min() >= 1
    for k, v in eng.state.items():
        assert torch.equal(v, fresh["state"][k]), f"state '{k}' differs"
