"""The engine's prefill programs (build --prefill-chunks, models/prefill_chunk.py) against the
eager reference prefill (models/step.py `prefill`), on the CPU in float64, through an engine
built with one step bucket and one chunk length C = 8 and loaded from disk.

What "writes what the reference writes" means here, per state tensor, with every tensor filled
with random bytes first (a reused row holds its previous request's data):
- every other state row (the trash row aside: scratch by design) is bit-equal to before;
- in the prefilled row, every element the reference left as it was is bit-equal to before: the
  padded tail of the last chunk writes nothing;
- every element the reference wrote is bit-equal to the reference's, except the compressor's
  state (rings, compressed entries, indexer keys) of a last chunk the prompt does not fill:
  MKL's fp64 GEMM rounds rows differently for fewer than 16 rows (measured: the compressor's
  wkv / wgate for 1..15 rows differ from the same rows of a 16-row product in the last bit), and
  the reference multiplies the n live rows where the program multiplies all C. Those elements
  agree within 1e-12 (a few ulps); prompts of whole chunks are bit-equal everywhere.
"""
import contextlib
import io
import random
import shutil

import pytest
import torch

from dspark_compile.runtime.lossless import check_lossless, greedy_reference
from dspark_compile.models.generate import set_row_sampling
from dspark_compile.models.request import SamplingParams
from dspark_compile.models.prefill_chunk import chunk_inputs, chunk_schedule
from dspark_compile.models.step import prefill

C = 8
SEQ = 48
ROW = 1            # the prefilled state row; row 0 and the others must stay as they were
LENGTHS = (1, C - 1, C, C + 1, 2 * C + 3)
# state written from the compressor's fp64 GEMMs (module docstring)
COMPRESSOR_KEYS = (".cmp_", ".idx_", ".ckv_")
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@pytest.fixture(scope="session")
def chunk_engine(tiny_ckpt, tmp_path_factory):
    """(manifest, Engine): session-scoped like tests/runtime/conftest.py's engines (the suite
    shuffles tests across modules; a module fixture would be rebuilt)."""
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.runtime.engine import Engine
    from dspark_compile.build.pipeline import build_engine
    out = tmp_path_factory.mktemp("rt_prefill") / "engine"
    manifest = build_engine(tiny_ckpt, out, BuildConfig(buckets=(1,), max_rows=2, max_seq_len=SEQ,
                                                        dtype="float64", prefill_chunks=(C,)),
                            log=lambda s: None)
    return manifest, Engine.load(out, device="cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t if not t.is_floating_point() else t.view(_BITS[t.element_size()])


def _fill_random(state: dict, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for v in state.values():
        if v.is_floating_point():
            v.copy_(torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype))
        else:
            v.copy_(torch.randint(0, 3, v.shape, generator=g).to(v.dtype))


def _compare(before: dict, ref: dict, got: dict, row: int, trash: int, exact: bool) -> None:
    for k in before:
        b, r, g = _bits(before[k]), _bits(ref[k]), _bits(got[k])
        others = [i for i in range(trash) if i != row]
        assert torch.equal(g[others], b[others]), f"{k}: another row changed"
        wrote = r[row] != b[row]
        assert torch.equal(g[row][~wrote], b[row][~wrote]), \
            f"{k}: the program wrote elements the reference did not (the padded tail?)"
        if exact or not any(s in k for s in COMPRESSOR_KEYS):
            assert torch.equal(g[row][wrote], r[row][wrote]), f"{k}: differs from the reference"
        else:
            x, y = got[k][row][wrote].double(), ref[k][row][wrote].double()
            assert torch.allclose(x, y, rtol=0, atol=1e-12), \
                f"{k}: max difference {float((x - y).abs().max())}"


def test_chunk_schedule():
    assert chunk_schedule(1, (8,)) == [(0, 1, 8)]
    assert chunk_schedule(19, (8,)) == [(0, 8, 8), (8, 8, 8), (16, 3, 8)]
    # full chunks of the largest length, then the smallest length that holds the rest
    assert chunk_schedule(1100, (64, 512)) == [(0, 512, 512), (512, 512, 512), (1024, 76, 512)]
    assert chunk_schedule(1060, (64, 512)) == [(0, 512, 512), (512, 512, 512), (1024, 36, 64)]
    assert chunk_schedule(100, (512, 64)) == [(0, 100, 512)]
    assert chunk_schedule(64, (64, 512)) == [(0, 64, 64)]
    with pytest.raises(ValueError, match="no chunk lengths"):
        chunk_schedule(3, ())


@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_program_writes_what_the_reference_writes(chunk_engine, length):
    from dspark_compile.models.state import snapshot_state
    _, eng = chunk_engine
    assert eng.prefill_programs is not None and eng.prefill_programs.chunks == [C]
    rng = random.Random(length)
    prompt = [rng.randrange(eng.cfg.vocab_size) for _ in range(length)]
    _fill_random(eng.state, length)
    set_row_sampling(eng.state, ROW, SamplingParams(temperature=0.8, top_k=5, seed=length))
    before = snapshot_state(eng.state)
    ref = snapshot_state(eng.state)
    first_ref = prefill(eng.model, ref, ROW, prompt, C, speculative=True)
    first = eng.prefill(ROW, prompt)
    assert first == first_ref
    _compare(before, ref, eng.state, ROW, eng.trash, exact=length % C == 0)
    # the first token and the first draft block, the next step's inputs
    assert torch.equal(eng.state["row.tokens"][ROW], ref["row.tokens"][ROW])
    assert int(eng.state["row.last_pos"][ROW]) == length - 1


def test_padded_tail_writes_nothing(chunk_engine):
    """One chunk of 3 live tokens twice from the same state, once with padding ids 0 and
    once with random ids in the padded tail: the same state and the same first token."""
    from dspark_compile.models.state import restore_state, snapshot_state
    _, eng = chunk_engine
    pp = eng.prefill_programs
    _fill_random(eng.state, 7)
    set_row_sampling(eng.state, ROW, SamplingParams())
    start = snapshot_state(eng.state)
    x = chunk_inputs(ROW, 5, [11, 12, 13], C)
    first = pp.modules[C](x, eng.state)
    after = snapshot_state(eng.state)
    restore_state(eng.state, start)
    x[3 + 3:] = torch.randint(0, eng.cfg.vocab_size, (C - 3,))
    again = pp.modules[C](x, eng.state)
    assert torch.equal(first, again)
    for k in after:
        assert torch.equal(_bits(after[k][:eng.trash]), _bits(eng.state[k][:eng.trash])), k


def test_generation_through_prefill_programs_is_lossless(chunk_engine):
    _, eng = chunk_engine
    pp = eng.prefill_programs
    calls = []
    module = pp.modules[C]
    pp.modules[C] = lambda x, state: (calls.append(int(x[2])), module(x, state))[1]
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(eng.cfg.vocab_size) for _ in range(n)] for n in (2, 2 * C + 1)]
        params = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=5)]
        res = eng.generate(prompts, params)
    finally:
        pp.modules[C] = module
    assert calls == [2, C, C, 1], "the prompts did not run the prefill programs"
    report = check_lossless(eng.model, prompts, params, res.tokens)
    assert report.ok, report.line()
    assert [len(t) for t in res.tokens] == [6, 5]


def test_manifest_records_the_prefill_programs(chunk_engine):
    from dspark_compile.engine_dir.format import PREFILL, ProgramKey
    m, eng = chunk_engine
    assert m["build_config"]["prefill_chunks"] == [C]
    entry = m["prefill_programs"][str(C)]
    assert entry["path"] == ProgramKey(PREFILL, C).path == f"programs/prefill_c{C}.json"
    assert entry["path"] in m["files"]
    assert entry["user_inputs"][0] == "inputs" and entry["shared_weights"]
    assert entry["shared_weights"] == m["programs"]["1"]["shared_weights"], \
        "the step and the prefill program share one set of weights"
    names = [r["name"] for r in m["pass_stats"][f"prefill_c{C}"]]
    assert names == [r["name"] for r in m["pass_stats"]["1"]]
    assert "check_state_in_place" in names
    # the fused kernels run in the prefill program too
    ops = {n.target._schema.name for n in eng.prefill_programs.modules[C].graph.nodes
           if n.op == "call_function" and hasattr(n.target, "_schema")}
    assert {"dspark::hc_post_pre", "dspark::qkv_postprocess", "dspark::markov_sample"} <= ops


@pytest.mark.parametrize("bad", [(-1,), (0, 8), (True,), ("8",), (SEQ + 1,), 8])
def test_bad_prefill_chunks_are_named(bad):
    from dspark_compile.engine_dir.build_config import BuildConfig
    with pytest.raises(ValueError, match="prefill_chunks"):
        BuildConfig(max_seq_len=SEQ, prefill_chunks=bad)


def test_prefill_chunks_flag_and_old_engines(chunk_engine, tmp_path):
    from dspark_compile.engine_dir.format import ArtifactError
    from dspark_compile.engine_dir.load import load_manifest
    from dspark_compile.engine_dir.write import update_manifest_field
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.cli.main import main
    from dspark_compile.engine_dir.fields import engine_configs
    assert BuildConfig(prefill_chunks=(0,)).prefill_chunks == ()
    assert BuildConfig(prefill_chunks=[512, 64, 64]).prefill_chunks == (64, 512)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main(["build", "ckpt", "--out", str(tmp_path / "e"), "--prefill-chunks", "8,x"])
    assert e.value.code == 2 and "--prefill-chunks" in err.getvalue()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["build", str(tmp_path / "none"), "--out", str(tmp_path / "e"),
                   "--prefill-chunks", "-4"])
    assert rc == 1 and "--prefill-chunks must be" in err.getvalue()
    m, eng = chunk_engine
    # an engine written before the field: no prefill programs, eager prefill
    old = {**m, "build_config": {k: v for k, v in m["build_config"].items()
                                 if k != "prefill_chunks"}}
    assert engine_configs(old)[1].prefill_chunks == ()
    bad = {**m, "build_config": {**m["build_config"], "prefill_chunks": [0, 4]}}
    with pytest.raises(ArtifactError, match="prefill_chunks"):
        engine_configs(bad)
    # a prefill program the file table does not hold is named
    copy = tmp_path / "engine"
    shutil.copytree(eng.dir, copy)
    update_manifest_field(copy, "prefill_programs.16",
                          {"path": "programs/prefill_c16.json", "shared_weights": []})
    with pytest.raises(ArtifactError, match="prefill_programs") as e:
        load_manifest(copy)
    assert e.value.field == "prefill_programs"


def test_prefill_choice_is_checked_before_loading(chunk_engine):
    from dspark_compile.runtime.engine import Engine
    _, eng = chunk_engine
    with pytest.raises(ValueError, match="prefill must be"):
        Engine.load(eng.dir, device="cpu", prefill="fast")


# ---------------------------------------------------------------------------------------- GPU
GPU_SEQ = 320
GPU_CHUNKS = (16, 64)
GPU_LENGTHS = (1, 15, 16, 17, 67, 200)     # 200: C128 blocks close (at 127), one in a chunk


@pytest.fixture(scope="session", params=[True, False], ids=["fp8-simulated", "no-fp8"])
def gpu_chunk_engine(tmp_path_factory, request):
    """float32 on the GPU, the backend the GPU engine tests take (--gpu-engine-backend); with
    FP8 simulated (activation quant, FP8 KV caches: the deployment numerics) and without.

    Why both: the programs run fused kernels (hc_post_pre, rmsnorm_quant, ...) where the eager
    reference runs the unfused ops, ~1e-7 relative apart in fp32. With FP8 simulated, such a
    difference sometimes moves a value across an FP8 rounding boundary or a top-k tie, and the
    layers after it then differ by far more than rounding (H200: 2.9 % of one layer's SWA FP8
    bytes at L = 16, an indexer key 4 % off at L = 200, a greedy divergence at a 1.8 % logit
    margin): there the programs are checked for what they write where and for the first token;
    without FP8 every written value is checked against the reference, and decoding is lossless."""
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.factory.synth import synth_checkpoint
    from dspark_compile.runtime.engine import Engine
    from dspark_compile.build.pipeline import build_engine
    fp8 = request.param
    root = tmp_path_factory.mktemp("gpu_prefill")
    ckpt = synth_checkpoint("tiny", root / "ckpt", seed=0)
    build_engine(ckpt, root / "engine", BuildConfig(
        buckets=(1, 4), max_rows=4, max_seq_len=GPU_SEQ, dtype="float32", device="cuda",
        backend=request.config.getoption("--gpu-engine-backend"), prefill_chunks=GPU_CHUNKS,
        act_quant=fp8, kv_fp8=fp8), log=lambda s: None)
    return fp8, Engine.load(root / "engine", device="cuda", trust_code=True)  # built here


def _worst(got: torch.Tensor, ref: torch.Tensor, wrote: torch.Tensor, tol: float) -> str:
    """Where a float comparison fails: how many written elements are out of tolerance, the worst
    one's index in the row's tensor, its two values, and the largest reference magnitude."""
    g, r = got.double(), ref.double()
    bad = wrote & ((g - r).abs() > tol / 10 + tol * r.abs())
    d = torch.where(wrote, (g - r).abs(), torch.zeros_like(g))
    at = tuple(int(i) for i in torch.unravel_index(d.argmax(), d.shape))
    return (f"{int(bad.sum())} of {int(wrote.sum())} written elements out of tolerance; worst at "
            f"{at} (shape {tuple(g.shape)}): program {float(g[at]):.6g}, reference "
            f"{float(r[at]):.6g}; max |reference| {float(r[wrote].abs().max()):.4g}")


def _gpu_compare(before: dict, ref: dict, got: dict, row: int, trash: int, values: bool) -> None:
    """Inertness bit for bit (other rows, elements the reference left); every element the
    reference wrote written by the program too; `values`: written floats within tolerance (the
    glue's and the fused kernels' rounding differs from the eager reference's: fp32 1e-3),
    written integers equal; else the row's last position equal."""
    for k in before:
        b, r, g = _bits(before[k]), _bits(ref[k]), _bits(got[k])
        others = [i for i in range(trash) if i != row]
        assert torch.equal(g[others], b[others]), f"{k}: another row changed"
        wrote = r[row] != b[row]
        assert torch.equal(g[row][~wrote], b[row][~wrote]), f"{k}: the program wrote more"
        x, y = got[k][row][wrote], ref[k][row][wrote]
        if not x.numel():
            continue
        if not values:
            # the program wrote what the reference wrote: the state was randomised first, so an
            # element left as it was is a missed write (but for an FP8 code redrawn equal)
            missed = (g[row][wrote] == b[row][wrote]).double().mean().item()
            assert missed <= 0.1, f"{k}: the program left {missed:.1%} of what the reference wrote"
            if k == "row.last_pos":
                assert torch.equal(x, y), k
            continue
        if x.is_floating_point():
            assert x.element_size() > 1, f"{k}: an FP8 cache in an engine built without FP8"
            tol = 1e-3
            assert torch.allclose(x.double(), y.double(), rtol=tol, atol=tol / 10), \
                f"{k}: " + _worst(got[k][row], ref[k][row], wrote, tol)
        else:
            assert torch.equal(x, y), k


@pytest.mark.gpu
@pytest.mark.parametrize("length", GPU_LENGTHS)
def test_gpu_prefill_program_matches_the_reference(gpu_chunk_engine, length):
    """The captured prefill programs vs the eager reference prefill on the GPU (its dspark::
    ops run the same Triton kernels; the glue is eager), chunked at the same boundaries:
    chunk_schedule only pads the last chunk, so the reference's chunk is the largest length."""
    from dspark_compile.models.state import snapshot_state
    fp8, eng = gpu_chunk_engine
    assert sorted(eng.prefill_programs.graphs) == list(GPU_CHUNKS)
    rng = random.Random(length)
    prompt = [rng.randrange(eng.cfg.vocab_size) for _ in range(length)]
    _fill_random(eng.state, length)
    set_row_sampling(eng.state, ROW, SamplingParams())
    before = snapshot_state(eng.state)
    ref = snapshot_state(eng.state)
    first_ref = prefill(eng.model, ref, ROW, prompt, max(GPU_CHUNKS), speculative=True)
    first = eng.prefill(ROW, prompt)
    assert first == first_ref
    _gpu_compare(before, ref, eng.state, ROW, eng.trash, values=not fp8)


@pytest.mark.gpu
def test_gpu_prefill_graph_equals_the_uncaptured_program(gpu_chunk_engine):
    from dspark_compile.models.state import restore_state, snapshot_state
    _, eng = gpu_chunk_engine
    pp = eng.prefill_programs
    prompt = list(range(3, 3 + 90))
    _fill_random(eng.state, 1)
    set_row_sampling(eng.state, ROW, SamplingParams(temperature=0.9, top_p=0.9, seed=4))
    start = snapshot_state(eng.state)
    first = pp.prefill(ROW, prompt, use_graphs=True)
    captured = snapshot_state(eng.state)
    restore_state(eng.state, start)
    assert pp.prefill(ROW, prompt, use_graphs=False) == first
    for k in captured:
        assert torch.equal(_bits(captured[k][:eng.trash]), _bits(eng.state[k][:eng.trash])), k


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_chunk_engine", [False], ids=["no-fp8"], indirect=True)
def test_gpu_generation_through_prefill_graphs_is_lossless(gpu_chunk_engine):
    """On the engine without FP8 simulation (gpu_chunk_engine says why not with it)."""
    _, eng = gpu_chunk_engine
    rng = random.Random(5)
    prompts = [[rng.randrange(eng.cfg.vocab_size) for _ in range(n)] for n in (5, 40, 130, 17)]
    params = [SamplingParams(max_new_tokens=16) for _ in prompts]
    res = eng.generate(prompts, params)
    report = check_lossless(eng.model, prompts, params, res.tokens, device="cuda")
    # float32: a divergence is accepted only at a near-tie of the target's logits
    assert report.ok or report.relative_margin < 1e-3, report.line()


def test_a_long_prompt_is_spread_over_steps_while_a_request_decodes(chunk_engine):
    """Through a stream with a budget of C prefill tokens per step: a prompt of 2C + 3 tokens
    (three chunk calls) joins while a request decodes; each of the next three step() calls runs
    one of its chunks and the decoding request commits tokens in every one of them; both
    outputs stay lossless."""
    _, eng = chunk_engine
    pp = eng.prefill_programs
    calls, step_no = [], [0]
    module = pp.modules[C]
    pp.modules[C] = lambda x, state: (calls.append((step_no[0], int(x[2]))), module(x, state))[1]
    rng = random.Random(9)
    prompts = [[rng.randrange(eng.cfg.vocab_size) for _ in range(n)] for n in (3, 2 * C + 3)]
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=5)]
    out = {0: [], 1: []}
    s = eng.open_stream(overlap=True, prefill_tokens=C)
    try:
        s.add(prompts[0], params[0])
        for step_no[0] in range(2):
            for e in s.step():
                out[e.request] += e.tokens
        s.add(prompts[1], params[1])
        for step_no[0] in range(2, 5):
            events = s.step()
            assert any(e.request == 0 and e.tokens for e in events), "the decoding row stalled"
            for e in events:
                out[e.request] += e.tokens
        assert s.cancel(0)       # its tokens so far are checked below; the rest is not needed
        while s.has_work:
            for e in s.step():
                out[e.request] += e.tokens
    finally:
        s.close()
        pp.modules[C] = module
    assert calls == [(0, 3), (2, C), (3, C), (4, 3)], calls
    report = check_lossless(eng.model, prompts[1:], params[1:], [out[1]])
    assert report.ok and len(out[1]) == 5, report.line()
    assert 0 < len(out[0]) < 30
    assert out[0] == greedy_reference(eng.model, prompts[0], len(out[0]))[0]


def test_the_first_tokens_logprob_comes_from_the_prefill_programs_variant(chunk_engine):
    """A logprobs request's first token is scored by the prompt's last chunk program's
    logprobs variant (runtime/logprobs.py): the same token as without, its logprob the eager
    reference prefill's log_softmax at the prompt's last position (fp32 rounding)."""
    _, eng = chunk_engine
    pp = eng.prefill_programs
    assert C in pp.logprob_modules, "the chunk program has no logprobs variant"
    prompt = [random.Random(5).randrange(eng.cfg.vocab_size) for _ in range(C + 3)]
    sp = SamplingParams(max_new_tokens=1)
    calls = []
    module = pp.logprob_modules[C]
    pp.logprob_modules[C] = lambda x, state: (calls.append(int(x[2])), module(x, state))[1]
    try:
        with eng.open_stream() as s:
            rid = s.add(prompt, sp, logprobs=2)
            events = [e for _ in range(3) if s.has_work for e in s.step() if e.request == rid]
    finally:
        pp.logprob_modules[C] = module
    assert calls == [3], "the last call did not run the variant (and only it)"
    tokens = [t for e in events for t in e.tokens]
    (lp, top), = [x for e in events for x in (e.logprobs or ())]
    state = eng.state
    set_row_sampling(state, 0, sp)
    first, logits = prefill(eng.model, state, 0, prompt, C, speculative=True, return_logits=True)
    assert tokens == [first]
    ls = torch.log_softmax(logits.double(), -1)
    assert abs(lp - ls[first].item()) < 2e-6
    assert [i for i, _ in top] == ls.topk(2).indices.tolist()
