"""The Inductor backend's compile path on the CPU, on a small step-shaped program (the tiny
model's step takes minutes to compile on 2 cores; the GPU tests build the real engine):
`(rows, state)` inputs, a state tensor updated in place by `index_copy_` and one by a `dspark::`
op that mutates its argument (`context_kv_store`), weight buffers. Compiled in worker processes and in-process, the saved
artifacts load as `CompiledStep`s whose outputs and state updates equal the exported program's.
Inductor's CPU code is C++: without a C++ compiler the tests skip."""
import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
    reason="Inductor's CPU backend needs a C++ compiler (none on PATH)")

D, ROWS = 16, 6


class MiniStep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w", torch.randn(D, D, generator=g))
        self.register_buffer("cos_sin", torch.randn(ROWS + 1, 8, generator=g))

    def forward(self, rows, state):
        h = torch.tanh(state["h"][rows] @ self.w)
        state["cache"].index_copy_(0, rows, h.unsqueeze(1).expand(-1, 3, -1).contiguous())
        slots = torch.where(rows < ROWS, rows, -1)             # the trash row writes nothing
        torch.ops.dspark.context_kv_store(h, rows, self.cos_sin, slots, state["ctx"])
        tokens = h.argmax(-1)
        return tokens, (h > 0).sum(-1)


def _state():
    g = torch.Generator().manual_seed(1)
    return {"h": torch.randn(ROWS + 1, D, generator=g), "cache": torch.zeros(ROWS + 1, 3, D),
            "ctx": torch.randn(ROWS + 1, D, generator=g)}


@pytest.fixture(scope="module")
def programs():
    import dspark_compile.kernels.qkv_postprocess  # noqa: F401  (registers the op)
    state = _state()
    return {b: torch.export.export(MiniStep(), (torch.arange(b), state), strict=False)
            for b in (1, 3)}, state


@pytest.mark.parametrize("workers", [2, 1])
def test_compiled_programs_equal_the_exported_ones(programs, workers, tmp_path):
    from dspark_compile.build.compile_workers import compile_programs
    from dspark_compile.engine_dir.format import STEP, ProgramKey
    from dspark_compile.runtime.inductor import CompiledStep
    eps, state = programs
    if workers == 1:            # the in-process path on one bucket: its compiles are serial
        eps = {3: eps[3]}
    lines = []
    keys = {b: ProgramKey(STEP, b) for b in eps}
    files, seconds, used = compile_programs({keys[b]: ep for b, ep in eps.items()}, state,
                                            workers, lines.append)
    assert used == min(workers, len(eps))
    assert sorted(files) == sorted(f"compiled/step_b{b}.bin" for b in eps)
    assert set(seconds) == set(keys.values()) and all(s["full"] > 0 for s in seconds.values())
    if workers > 1:
        assert any("worker processes" in line for line in lines), lines
    for b, ep in eps.items():
        path = tmp_path / f"b{b}.bin"
        path.write_bytes(files[keys[b].compiled_path])
        rows = torch.tensor([4, 0, ROWS][:b])
        ref_state, got_state = _state(), _state()
        want = ep.module()(rows, ref_state)
        step = CompiledStep(path, _as_loaded(ep), rows, got_state)
        got = step(rows, got_state)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        for k in ref_state:
            torch.testing.assert_close(got_state[k], ref_state[k], rtol=1e-6, atol=1e-6,
                                       msg=f"state '{k}' after the compiled step")
        for k in ("cache", "ctx"):
            assert not torch.equal(got_state[k], _state()[k]), f"state '{k}' was not written"


def _as_loaded(ep):
    """The program as an engine load gives it to CompiledStep: written in the engine's format,
    read back and bound to its weights."""
    from dspark_compile.engine_dir.graph_format import dump_program
    from dspark_compile.engine_dir.graph_read import read_program
    return read_program(*dump_program(ep)).bind({**ep.state_dict, **ep.constants})


def test_a_failing_worker_names_its_bucket(programs, monkeypatch):
    import dspark_compile.build.compile_workers as cw
    from dspark_compile.engine_dir.format import STEP, ProgramKey
    eps, state = programs
    bad = {ProgramKey(STEP, 1): eps[1]}
    monkeypatch.setattr(cw.sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="compiling step_b1 \\(full\\) failed in its worker"):
        cw.compile_programs(bad, state, 2, lambda s: None)


def test_an_unreadable_compiled_program_is_named(programs, tmp_path):
    from dspark_compile.engine_dir.format import ArtifactError
    from dspark_compile.runtime.inductor import CompiledStep
    eps, state = programs
    bad = tmp_path / "step_b1.bin"
    bad.write_bytes(b"not an artifact")
    with pytest.raises(ArtifactError, match="cannot load compiled program 'step_b1.bin'"):
        CompiledStep(bad, _as_loaded(eps[1]), torch.arange(1), state)
    with pytest.raises(ValueError, match="keys or their order differ"):
        CompiledStep(bad, _as_loaded(eps[1]), torch.arange(1),
                     {k: state[k] for k in reversed(state)})


def test_the_backend_decides_what_each_compile_is(programs):
    """compiled.py alone decides what a build compiles (the workers only run it): a program
    without the Markov sampler has only its full variant, a greedy variant of it is refused,
    and the example input has the program's first input's shape."""
    from dspark_compile.build.inductor import example_input, variant_graph, variants_of
    eps, _ = programs
    assert variants_of(eps[1]) == ["full"]
    assert isinstance(variant_graph(eps[1], "full"), torch.fx.GraphModule)
    with pytest.raises(ValueError, match="no dspark::markov_sample call"):
        variant_graph(eps[1], "greedy")
    with pytest.raises(ValueError, match="variant must be one of"):
        variant_graph(eps[1], "fast")
    assert example_input(eps[3], "cpu").tolist() == [0, 1, 2]
