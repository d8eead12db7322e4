"""The engine on a CUDA GPU (skips without one): CUDA-graph replay equals the
uncaptured program for every bucket with padded batches, capture time and graph memory are
recorded in the manifest, and greedy decoding through the graphs is lossless.

The engine is built on the GPU inside the test (`device="cuda"`): the manifest pins the torch
version and the SM, so an engine built elsewhere would not load. float32, FP8 KV and activation
quant simulated (the deployment numerics, in a wider dtype).
"""
import json
import random
import time

import pytest
import torch

from dspark_compile.models.state import restore_state as _restore
from dspark_compile.models.state import snapshot_state as _snapshot
from dspark_compile.engine_dir.build_config import DEFAULT_BUCKETS
from dspark_compile.engine_dir.format import STEP, ProgramKey

pytestmark = pytest.mark.gpu

SEQ = 256
# a greedy divergence is accepted only as a near-tie: |logit margin| / |top-1 logit| below this
NEAR_TIE = 1e-3


def _buckets(config) -> tuple:
    """The buckets under test: --gpu-engine-buckets, else every default bucket."""
    opt = config.getoption("--gpu-engine-buckets")
    return tuple(int(b) for b in opt.split(",")) if opt else tuple(DEFAULT_BUCKETS)


def pytest_generate_tests(metafunc):
    if "bucket" in metafunc.fixturenames:
        metafunc.parametrize("bucket", _buckets(metafunc.config))


@pytest.fixture(scope="module")
def buckets(request):
    return _buckets(request.config)


@pytest.fixture(scope="module")
def gpu_engine(tmp_path_factory, buckets, request):
    from dspark_compile.factory.synth import synth_checkpoint
    from dspark_compile.runtime.engine import Engine
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.build.pipeline import build_engine

    root = tmp_path_factory.mktemp("gpu_engine")
    ckpt = synth_checkpoint("tiny", root / "ckpt", seed=0)
    t = time.perf_counter()
    build_engine(ckpt, root / "engine", BuildConfig(buckets=buckets, max_rows=64,
                                                    max_seq_len=SEQ, dtype="float32",
                                                    device="cuda",
                                                    backend=request.config.getoption(
                                                        "--gpu-engine-backend")),
                 log=lambda s: None)
    build_s = time.perf_counter() - t
    eng = Engine.load(root / "engine", device="cuda", trust_code=True)  # built here
    capture = {b: round(s, 3) for b, s in eng.capture_seconds.items()}
    print(f"\nGPU engine: build {build_s:.1f}s, load + capture {eng.load_seconds:.1f}s, "
          f"capture per bucket {json.dumps(capture)}, pool bytes {eng.graph_pool_bytes}")
    return eng


@pytest.fixture(scope="module")
def live_rows(gpu_engine):
    """All 64 state rows prefilled with mixed prompts and sampling settings."""
    from dspark_compile.models.random_requests import prefill_random_requests
    eng = gpu_engine
    rows = list(range(eng.cache.max_rows))
    prefill_random_requests(eng.model, eng.state, rows, 0, eng.cache.max_step_tokens,
                            max_prompt_len=30)
    return rows


def state_differences(a: dict, b: dict, trash: int):
    """(tensors not bit-equal, of those the float ones equal within 1e-5 relative) over every
    row but the trash row (garbage by design: padded rows read and write it). The sampler's
    candidate compaction uses atomics, so a float reduction may legitimately change order
    between two runs; everything else is expected bit-equal. NaN never compares close."""
    differ, close = [], []
    for k in a:
        x, y = a[k][:trash], b[k][:trash]
        if torch.equal(x, y):
            continue
        differ.append(k)
        if x.is_floating_point() and x.element_size() > 1 and torch.allclose(x, y, rtol=1e-5,
                                                                              atol=1e-6):
            close.append(k)
    return differ, close


def test_engine_captured_every_bucket(gpu_engine, buckets):
    eng = gpu_engine
    captured = eng.captured()
    for variant in ("full", "greedy"):
        assert sorted(k.size for k in captured if k.kind == STEP and k.variant == variant) \
            == sorted(buckets)
    assert set(eng.capture_seconds) == set(buckets)
    assert all(s > 0 for s in eng.capture_seconds.values())
    assert eng.graph_pool_bytes[max(buckets)] > 0, "the largest bucket allocates the pool"


def test_manifest_records_capture_time_and_graph_memory(gpu_engine, buckets):
    from dspark_compile.engine_dir.load import load_manifest

    eng = gpu_engine
    m = load_manifest(eng.dir)               # still valid: the checksum was updated
    major, minor = torch.cuda.get_device_capability()
    assert m["target_sm"] == f"sm_{major}{minor}" and m["torch_version"] == torch.__version__
    assert m["graph_memory_bytes"] == {str(b): eng.graph_pool_bytes[b] for b in buckets}
    assert all(isinstance(v, int) and v >= 0 for v in m["graph_memory_bytes"].values())
    rl = m["runtime_load"]
    assert rl["device"] == torch.cuda.get_device_name()
    assert rl["load_seconds"] > 0
    assert set(rl["capture_seconds"]) == {str(b) for b in buckets}
    assert all(v > 0 for v in rl["capture_seconds"].values())
    assert rl["graph_pool_total_bytes"] == sum(eng.graph_pool_bytes.values())


@pytest.mark.parametrize("variant", ["full", "greedy"])
def test_graph_replay_equals_uncaptured_program(gpu_engine, live_rows, bucket, variant):
    """Same state copy, two ways: the program run directly vs its captured graph replayed.
    Padded batch: bucket - 1 live rows (scattered state rows) and the trash row among them.
    variant "greedy": the batch's rows made greedy, the bucket's greedy variant."""
    eng = gpu_engine
    rng = random.Random(bucket)
    n_live = max(1, bucket - 1)
    rows = rng.sample(live_rows, n_live)
    if bucket > 1:
        rows.insert(rng.randrange(n_live + 1), eng.trash)
    temps = eng.state["row.temperature"].clone()     # put back below: the state is shared
    if variant == "greedy":
        eng.state["row.temperature"][rows] = 0.0
    snap = _snapshot(eng.state)
    t_prog, n_prog = eng.run_step(rows, use_graph=False, bucket=bucket, variant=variant)
    after_prog = _snapshot(eng.state)
    _restore(eng.state, snap)
    t_graph, n_graph = eng.run_step(rows, use_graph=True, bucket=bucket, variant=variant)
    assert torch.equal(t_prog, t_graph) and torch.equal(n_prog, n_graph), (t_prog, t_graph)
    live = [i for i, r in enumerate(rows) if r != eng.trash]
    assert (n_graph[live] >= 1).all(), "a live row committed nothing"
    pad = [i for i, r in enumerate(rows) if r == eng.trash]
    assert (n_graph[pad] == 0).all() and (t_graph[pad] == -1).all(), "a padded row emitted tokens"
    differ, close = state_differences(eng.state, after_prog, eng.trash)
    if differ:
        print(f"bucket {bucket}: state tensors not bit-equal after replay vs program: {differ}")
    bad = sorted(set(differ) - set(close))
    assert not bad, f"state after replay differs from the uncaptured program's: {bad}"
    # padding is inert: rows outside the batch are untouched. The trash row is never checked,
    # even when it is not in the batch (bucket 1): the step sinks masked writes of live rows
    # into it too (compressed-KV slots of incomplete blocks, draft context slots), as
    # tests/runtime/test_engine.py states on CPU.
    keep = torch.ones(eng.trash + 1, dtype=torch.bool, device=eng.device)
    keep[rows + [eng.trash]] = False
    for k, v in eng.state.items():
        assert torch.equal(v[keep], snap[k][keep]), f"state '{k}': a row outside the batch changed"
    eng.state["row.temperature"].copy_(temps)


def test_prefill_is_deterministic_on_the_gpu(gpu_engine):
    """Prompts longer than the draft context ring (8 slots) prefill bit-identically twice: a
    repeated index in a ring write has no defined winner on CUDA (models/batch.py ring_slots)."""
    from dspark_compile.models.random_requests import prefilled_state
    eng = gpu_engine
    _, a = prefilled_state(eng.model, eng.cache, 4, 13)
    _, b = prefilled_state(eng.model, eng.cache, 4, 13)
    # the trash row is left out: every dropped write of a ring lands in its scratch slot
    t = eng.cache.max_rows
    differ = [k for k in a if not torch.equal(a[k][:t], b[k][:t])]
    assert not differ, f"two prefills of the same prompts differ in {differ}"


def _allocations(fn) -> list[int]:
    """Sizes in bytes of every device allocation `fn()` makes (the caching allocator's trace)."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return [e["size"] for trace in snap["device_traces"] for e in trace if e["action"] == "alloc"]


def _whole_state_copies(eng, fn, rows: list[int]) -> list[str]:
    """Cache-sized state tensors of which one uncaptured call `fn(rows, state)` allocates a
    buffer of exactly their size (the state is restored after).

    A whole copy of a state tensor is one allocation of exactly its size (the caching allocator
    rounds requests up to 512 bytes); other buffers of the step are as large as the tiny
    model's caches (an fp32 weight temporary is 6 MiB), so sizes must match exactly. Only
    tensors >= 1 MiB are checked: caches, not per-row scalars whose size a small activation
    may share."""
    snap = _snapshot(eng.state)
    padded = torch.tensor(rows, dtype=torch.int64, device=eng.device)
    with torch.no_grad():
        fn(padded, eng.state)                      # warm: first-call allocations
        _restore(eng.state, snap)
        sizes = _allocations(lambda: fn(padded, eng.state))
    _restore(eng.state, snap)
    caches = {-(-v.numel() * v.element_size() // 512) * 512: k for k, v in eng.state.items()
              if v.numel() * v.element_size() >= 1 << 20}
    assert caches, "no cache-sized state tensor: the threshold no longer fits this engine"
    return sorted({caches[n] for n in sizes if n in caches})


def test_compiled_step_updates_the_state_in_place(gpu_engine, live_rows, bucket):
    """The in-place invariant on what actually runs: one uncaptured call of the bucket's step
    (the Inductor-compiled program for an inductor engine) allocates no buffer of a cache's
    size (a whole-cache copy needs one: functionalisation's index_put + copy_ back, a clone of
    a mutated custom-op argument)."""
    eng = gpu_engine
    rows = random.Random(bucket).sample(live_rows, bucket)
    copies = _whole_state_copies(eng, eng.program(ProgramKey(STEP, bucket)).fn, rows)
    assert not copies, (f"bucket {bucket} ({eng.backend}): one call allocates a buffer of the "
                        f"exact size of state {copies}: a whole-state copy")


def test_the_in_place_check_catches_a_functionalised_step(gpu_engine, live_rows, buckets):
    """The check above can fail: the same program functionalised (`run_decompositions()`:
    every cache update an out-of-place index_put copied back) is caught."""
    eng = gpu_engine
    b = min(buckets)
    program = eng.programs[b]        # traced again at this bucket's size (a dynamic program too)
    functional = program.exported({k: b for k in program.sizes}).run_decompositions().module()
    copies = _whole_state_copies(eng, functional, random.Random(b).sample(live_rows, b))
    assert copies, "a functionalised step's whole-cache copies went unnoticed"


def test_engine_runs_the_backend_it_was_built_with(gpu_engine, buckets, request):
    eng = gpu_engine
    backend = request.config.getoption("--gpu-engine-backend")
    assert eng.backend == backend == eng.manifest["build_config"]["backend"]
    if backend == "inductor":
        from dspark_compile.runtime.inductor import CompiledStep
        assert all(isinstance(eng.program(ProgramKey(STEP, b, v)).fn, CompiledStep)
                   for b in buckets for v in ("full", "greedy"))
        secs = eng.manifest["compiled"]["compile_seconds"]
        assert set(secs) == {str(b) for b in buckets}
        assert all(s > 0 for per in secs.values() for s in per.values())
        assert set(eng.compiled_load_seconds) == set(buckets)


def test_greedy_generation_through_graphs_is_lossless(gpu_engine, buckets):
    """Greedy speculative decoding through the CUDA graphs vs greedy decoding of the target
    alone (eager, same GPU). A divergence must be a near-tie of the target's logits; every
    report is printed."""
    from dspark_compile.runtime.lossless import check_lossless
    from dspark_compile.models.request import SamplingParams
    from dspark_compile.runtime.engine import StepTimes

    eng = gpu_engine
    rng = random.Random(7)
    V = eng.cfg.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (1, 4, 9, 17, 30, 45, 60, 12, 3)]
    params = [SamplingParams(max_new_tokens=n) for n in (40, 32, 24, 48, 16, 40, 30, 8, 1)]
    eng.times = StepTimes()
    res = eng.generate(prompts, params)
    # rows finish at different steps and move to smaller buckets, where there is one below the
    # first step's (buckets 32,64 run every step in 32). The request of one new token ends at
    # prefill; more rows than the largest bucket run in groups of it.
    first = sum(sp.max_new_tokens > 1 for sp in params)
    if any(b < eng.bucket_for(min(first, max(buckets))) for b in buckets):
        assert len(eng.times.per_bucket) >= 2, eng.times
    assert sum(res.accepted_at) > 0, "no draft accepted"
    exact, ties = 0, []
    for i, (p, sp, out) in enumerate(zip(prompts, params, res.tokens)):
        report = check_lossless(eng.model, [p], [sp], [out], device=eng.device)
        print(f"request {i}: {report.line()}")
        if report.ok:
            exact += 1
            continue
        assert report.relative_margin < NEAR_TIE, (
            f"request {i}: not a near-tie (relative margin {report.relative_margin:.2e}): "
            + report.line())
        ties.append(i)
    print(f"lossless on {torch.cuda.get_device_name()}: {exact}/{len(prompts)} exact, near-ties "
          f"in requests {ties}; mean accepted length {res.mean_accepted_length:.2f}")


def _stream_requests(eng, seed: int):
    """Greedy and sampled requests of mixed lengths (fewer than the rows: all admitted at once)."""
    from dspark_compile.models.request import SamplingParams
    rng = random.Random(seed)
    V = eng.cfg.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (1, 5, 12, 30, 7, 44, 3, 20)]
    params = [SamplingParams(max_new_tokens=n) for n in (24, 40, 16, 32, 28, 12, 36, 20)]
    for i in (1, 4, 6):
        params[i] = SamplingParams(max_new_tokens=params[i].max_new_tokens, temperature=0.9,
                                   top_p=0.95, seed=seed + i)
    return prompts, params


def test_stream_through_graphs_equals_the_programs(gpu_engine):
    """The stream path (Engine.launch: pinned copies, packed outputs, replay) on the captured
    graphs against the same loop on the uncaptured programs (graphs set aside), serial both, so
    every step has the same rows: the same tokens for every request, greedy and sampled."""
    eng = gpu_engine
    prompts, params = _stream_requests(eng, 3)
    on_graphs = eng.generate(prompts, params, overlap=False)
    kept = {k: p.graph for k, p in eng.table.items()}
    for p in eng.table.values():
        p.graph = None
    try:
        programs = eng.generate(prompts, params, overlap=False)
    finally:
        for k, g in kept.items():
            eng.table[k].graph = g
    assert on_graphs.tokens == programs.tokens
    assert (on_graphs.row_steps, on_graphs.accepted_at) == (programs.row_steps,
                                                            programs.accepted_at)


def test_overlapped_loop_on_graphs_equals_the_serial_loop(gpu_engine):
    """Step n + 1 launched before step n is read (overlap, the CUDA default) against the serial
    loop, on the graphs: every request's tokens equal. A step launched ahead carries rows that
    ended at the step before, so a batch may sit in a larger bucket than in the serial loop; a
    greedy output may then differ only where the target's logits nearly tie (the bucket's GEMMs
    round differently), which check_lossless reports for both outputs."""
    from dspark_compile.runtime.lossless import check_lossless
    from dspark_compile.runtime.engine import StepTimes
    eng = gpu_engine
    prompts, params = _stream_requests(eng, 4)
    serial = eng.generate(prompts, params, overlap=False)
    eng.times = StepTimes()
    overlap = eng.generate(prompts, params, overlap=True)
    assert eng.times.steps >= overlap.steps
    for i, (a, b, sp) in enumerate(zip(overlap.tokens, serial.tokens, params)):
        assert len(a) == len(b) == sp.max_new_tokens, i
        if a == b:
            continue
        assert sp.temperature <= 0, f"sampled request {i}: overlap {a} != serial {b}"
        for out in (a, b):
            r = check_lossless(eng.model, [prompts[i]], [sp], [out], device=eng.device)
            assert r.ok or r.relative_margin < NEAR_TIE, f"request {i}: {r.line()}"
