"""The engine's own program format (dspark_compile/engine_dir/graph_format.py, graph_read.py): a
post-pass tiny step written as data and read back runs exactly as `ep.module()` does (same graph,
outputs and state bit for bit), and a program file holding anything but the format's data is
refused, naming what it holds."""
from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dspark_compile.engine_dir.format import ArtifactError
from dspark_compile.engine_dir.graph_format import dump_program
from dspark_compile.engine_dir.graph_read import read_program
from dspark_compile.passes import PassManager
from dspark_compile.runtime.variants import sampler_mode_variant, switch_sampler_mode


def _tiny_step_lib():
    # the module tests/passes/conftest.py loads (same name: one copy per session)
    name = "dspark_tests_tiny_step"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parent / "passes" / "tiny_step.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny step (bucket 2, float32, FP8 simulated) after the default pass pipeline, as
    the build writes it (no example inputs), with its weights as the engine stores them."""
    ts = _tiny_step_lib().TinyStep(tmp_path_factory.mktemp("graph_format"), dtype="float32")
    ep = ts.exported
    PassManager().run(ep, state_inputs=ts.states(ep))
    ep.example_inputs = None
    weights = {**ep.state_dict, **ep.constants}
    return ts, ep, weights


@pytest.fixture(scope="module")
def dumped(tiny):
    _, ep, _ = tiny
    return dump_program(ep)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _run(fn, ts, seed: int):
    """(outputs, state after the step) of `fn(rows, state)` on the prefilled state `seed`."""
    from dspark_compile.models.random_requests import prefilled_state
    rows, state = prefilled_state(ts.model, ts.cache, 2, seed)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = fn(rows, state)
    return out, state


def _assert_same_run(ref, got) -> None:
    (ref_out, ref_state), (got_out, got_state) = ref, got
    assert len(ref_out) == len(got_out)
    for i, (a, b) in enumerate(zip(ref_out, got_out)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"output {i}"
        assert torch.equal(_bits(a), _bits(b)), f"output {i} is not bit-identical"
    assert list(ref_state) == list(got_state) and len(ref_state) > 10
    for k, a in ref_state.items():
        # NaN rows (greedy requests' draft logits) compare equal as bits
        assert torch.equal(_bits(a), _bits(got_state[k])), f"state '{k}' is not bit-identical"


def test_graph_round_trip_has_ep_modules_nodes(tiny, dumped):
    """The rebuilt graph is ep.module()'s node for node: op, target and name, in order."""
    _, ep, weights = tiny
    gm = read_program(*dumped).module(weights)
    ref = ep.module()
    got_nodes, ref_nodes = list(gm.graph.nodes), list(ref.graph.nodes)
    assert len(got_nodes) == len(ref_nodes) > 1000
    # lifted tensors are flat attributes named as their placeholders (no submodule tree)
    assert [(n.op, n.target, n.name) for n in got_nodes if n.op != "get_attr"] == \
        [(n.op, n.target, n.name) for n in ref_nodes if n.op != "get_attr"]
    assert [n.op for n in got_nodes] == [n.op for n in ref_nodes]
    assert all(n.target == n.name for n in got_nodes if n.op == "get_attr")
    # the weights are the engine's tensors themselves, never copies
    assert gm.get_buffer("b_model_embed_weight") is weights["model.embed.weight"]


def test_round_trip_runs_bit_identical_to_ep_module(tiny, dumped):
    """Outputs and every state tensor after the step equal ep.module()'s bit for bit, on
    fresh prefilled states (the state is updated in place by the graph's own in-place ops)."""
    ts, ep, weights = tiny
    program = read_program(*dumped)
    assert program.state_keys == list(ep.call_spec.in_spec.child(0).child(1).context)
    placeholders = {n.name: n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"}
    assert program.state_meta == {
        k: (placeholders[name].dtype, tuple(placeholders[name].shape))
        for k, name in zip(program.state_keys, ep.graph_signature.user_inputs[1:])}
    assert sorted(program.weight_names) == sorted(weights)
    for seed in (0, 1):
        _assert_same_run(_run(ep.module(), ts, seed), _run(program.module(weights), ts, seed))


def test_runner_runs_bit_identical_to_ep_module_and_its_source_holds_no_file_text(tiny,
                                                                                   dumped):
    """ProgramRunner (engine_dir/graph_run.py: the engine's fast callable) leaves the same
    outputs and state as ep.module() bit for bit; its generated function names values by
    position and takes every literal, operator and tensor from its pools, so none of the file's
    names or literals is in its code; calls of another shape are refused like the module's."""
    from dspark_compile.engine_dir.graph_run import ProgramRunner
    ts, ep, weights = tiny
    program = read_program(*dumped)
    runner = ProgramRunner(program, weights)
    for seed in (0, 1):
        _assert_same_run(_run(ep.module(), ts, seed), _run(runner, ts, seed))
    code = runner._run.__code__
    assert all(c is None or type(c) is int for c in code.co_consts), code.co_consts[:10]
    assert set(code.co_names) == set()
    assert all(re.fullmatch(r"_[awk]|_ops|[awvc]\d+", v) for v in code.co_varnames)
    assert runner.get_buffer("b_model_embed_weight") is weights["model.embed.weight"]
    assert len(runner.graph.nodes) == len(ep.module().graph.nodes)   # tools: the fx graph
    from dspark_compile.models.random_requests import prefilled_state
    rows, state = prefilled_state(ts.model, ts.cache, 2, 0)
    with pytest.raises(ValueError, match="input 'rows' must be"):
        runner(rows[:1], state)


def test_greedy_variant_written_at_build_matches_load_time_variant(tiny):
    """The greedy variant made on the exported program (at build time) and written in the
    format runs as runtime/variants.py's load-time variant of ep.module() does."""
    ts, ep, weights = tiny
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        greedy_ep = copy.deepcopy(ep)
    switch_sampler_mode(greedy_ep.graph_module, "greedy")
    program = read_program(*dump_program(greedy_ep))
    ref = sampler_mode_variant(ep)
    assert len(program.nodes) < sum(n.op == "call_function" for n in ep.graph.nodes)
    _assert_same_run(_run(ref, ts, 2), _run(program.module(weights), ts, 2))


class _Mutating(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(3))
        self.scale = torch.nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x, state):
        self.acc.add_(x)
        state["count"].add_(1)
        return (x * self.scale + torch.tensor([1.0, -1.0, 0.5]), self.acc.sum())


def test_constants_and_functional_mutations_round_trip():
    """A functionalised program (mutations as outputs: a buffer and a user input), a lifted
    constant stored in the program's constants file and a parameter: ep.module() and the
    format's module leave the same state and return the same outputs."""
    x, count = torch.randn(3), torch.zeros((), dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(_Mutating(), (x, {"count": count})).run_decompositions()
    kinds = {s.kind.name for s in ep.graph_signature.output_specs}
    assert {"BUFFER_MUTATION", "USER_INPUT_MUTATION"} <= kinds
    graph, constants = dump_program(ep)
    assert constants is not None
    program = read_program(graph, constants)
    weights = {k: v.clone() for k, v in ep.state_dict.items()}
    ref, got = ep.module(), program.module(weights)
    c_ref, c_got = count.clone(), count.clone()
    for _ in range(2):
        a, b = ref(x, {"count": c_ref}), got(x, {"count": c_got})
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert int(c_ref) == int(c_got) == 2
    assert torch.equal(ref.acc, got.b_acc) and got.b_acc is weights["acc"]
    # the constants file must hold the graph's constants, at the sizes the graph says
    from safetensors.torch import load, save
    (name, t), = load(constants).items()
    for bad, says in ((save({name: t[:1].clone()}), f"constant '{name}' is"),
                      (save({name: t, "extra": t.clone()}), r"unexpected \['extra'\]"),
                      (None, "no constants file")):
        with pytest.raises(ArtifactError, match=says):
            read_program(graph, bad)


def test_calls_of_another_shape_are_refused(tiny, dumped):
    ts, _, weights = tiny
    fn = read_program(*dumped).module(weights)
    from dspark_compile.models.random_requests import prefilled_state
    rows, state = prefilled_state(ts.model, ts.cache, 2, 0)
    key = next(iter(state))
    with pytest.raises(ValueError, match=f"input 'state_.*' must be"):
        fn(rows, {**state, key: state[key][:1]})
    with pytest.raises(ValueError, match="inputs are"):
        fn(rows, {k: v for k, v in state.items() if k != key})
    with pytest.raises(TypeError, match="positional"):
        fn(rows, state=state)


# --------------------------------------------------------------------------- hostile files
def _node(doc, op):
    return next(n for n in doc["nodes"] if n["op"] == op)


def _first_weight(doc):
    return next(i for i in doc["inputs"] if i["kind"] != "user")


def _edits():
    """(name, edit of the graph document, what the refusal says)."""
    def op(o):
        return lambda d: d["nodes"][0].update(op=o)

    def arg(v):
        return lambda d: d["nodes"][0]["args"].append(v)

    def nest(depth):
        v = 1
        for _ in range(depth):
            v = [v]
        return v

    return [
        ("os.system as an op", op("torch.os.system"), "not a registered aten"),
        ("builtins.eval as an op", op("builtins.eval"), "not a registered aten"),
        ("an op outside the namespaces", op("higher_order.cond.default"), "not a registered"),
        ("an aten op that does not exist", op("aten.no_such_op.default"), "not a registered"),
        ("a pickle literal", arg({"pickle": "gASV"}), "literal"),
        ("an object literal of two keys", arg({"node": "rows", "dtype": "int64"}), "literal"),
        ("an unknown dtype", arg({"dtype": "object"}), "literal"),
        ("a device string with code", arg({"device": "cuda:0'); import os; ('"}), "literal"),
        ("a reference to nothing", arg({"node": "nowhere"}), "names no placeholder"),
        ("a reference to a later node",
         lambda d: d["nodes"][0]["args"].append({"node": d["nodes"][-1]["name"]}),
         "names no placeholder"),
        ("a literal nested too deep", arg(nest(50)), "deeper than"),
        ("a node name that is code",
         lambda d: d["nodes"][0].update(name="x = __import__('os')"), "not an identifier"),
        ("a weight target that is code",
         lambda d: _first_weight(d).update(target='model.x"), __import__("os'),
         "not a dotted name"),
        ("a node defined twice",
         lambda d: d["nodes"][1].update(name=d["nodes"][0]["name"]), "defined twice"),
        ("an unknown top-level field", lambda d: d.update(code="print(1)"), "unknown field"),
        ("an unknown node field", lambda d: d["nodes"][0].update(meta={}), "unknown field"),
        ("another version", lambda d: d.update(version=0), "rebuild"),
        ("keyword arguments in in_spec",
         lambda d: d["in_spec"]["tuple"][1].update(dict=[["x');import os#", "*"]]),
         "positional arguments only"),
        ("an in_spec of a set", lambda d: d.update(in_spec={"set": []}), "not a tuple"),
        ("an input the in_spec lacks",
         lambda d: d["in_spec"]["tuple"][0]["tuple"][1]["dict"].pop(), "user inputs"),
        ("an out_spec of other leaves",
         lambda d: d["out_spec"]["tuple"].append("*"), "user outputs"),
        ("a negative size", lambda d: _first_weight(d).update(shape=[-1]), "shape"),
        ("a mutation of a non-input",
         lambda d: d["outputs"].append({"kind": "buffer_mutation", "target": "nothing",
                                        "value": d["outputs"][0]["value"]}), "not a buffer"),
        ("getitem of a literal",
         lambda d: _node(d, "operator.getitem").update(args=[1, 0]), "getitem"),
        ("a keyword the op lacks",
         lambda d: _node(d, "aten.view.default")["kwargs"].update(evil=1), "keyword"),
        ("too many positional arguments",
         lambda d: _node(d, "aten.view.default")["args"].extend([1, 2, 3]), "positional"),
        ("a constant without a constants file",
         lambda d: (_first_weight(d).update(kind="constant", stored="program"),
                    _first_weight(d).pop("persistent")),
         "no constants file"),
        ("an argument named self", lambda d: d.update(arg_names=["self", "state"]), "self"),
        ("an argument named torch", lambda d: d.update(arg_names=["torch", "state"]),
         "the module's code uses"),
        ("an int beyond 64 bits", arg(2 ** 70), "outside 64 bits"),
        ("a bool as the version", lambda d: d.update(version=True), "rebuild"),
    ]


EDITS = _edits()


@pytest.mark.parametrize("edit", EDITS, ids=[e[0] for e in EDITS])
def test_hostile_graph_refused_by_name(dumped, edit):
    graph, constants = dumped
    _, change, says = edit
    doc = json.loads(graph)
    change(doc)
    with pytest.raises(ArtifactError, match=says) as e:
        read_program(json.dumps(doc).encode(), constants, rel="programs/step_b2.json")
    assert "programs/step_b2.json" in str(e.value) and e.value.path == "programs/step_b2.json"


@pytest.mark.parametrize("data, says", [
    (b"\x80\x04\x95" + b"\x00" * 16, "not readable JSON"),               # a pickle
    (b"[" * 100_000 + b"]" * 100_000, "not readable JSON|not an object"),  # deep JSON
    (b'{"format": "dspark-graph", "format": "x"}', "given twice"),
    (b"[]", "not an object"),
    (b'{"format": NaN}', "not readable JSON"),
], ids=["pickle", "deep json", "duplicate key", "not an object", "NaN token"])
def test_unreadable_graph_refused(data, says):
    with pytest.raises(ArtifactError, match=says):
        read_program(data, None)


def test_weights_and_constants_of_other_sizes_refused(tiny, dumped):
    _, _, weights = tiny
    program = read_program(*dumped)
    name = program.weight_names[0]
    with pytest.raises(ArtifactError, match=f"'{name}' from the engine's weights, which hold no"):
        program.module({k: v for k, v in weights.items() if k != name})
    with pytest.raises(ArtifactError, match=f"expects '{name}' as"):
        program.module({**weights, name: weights[name].double()})
    with pytest.raises(ArtifactError, match="not a readable safetensors"):
        read_program(dumped[0], b"\x80\x04 a pickle")


def test_weight_names_clashing_with_module_attributes_refused(tiny, dumped):
    """A lifted input named like a module attribute (forward, training, the GraphModule's
    graph or code) would replace it: refused, naming it."""
    _, _, weights = tiny
    text = dumped[0].decode()
    old = _first_weight(json.loads(text))["name"]
    for bad in ("forward", "graph", "training", "code", "register_buffer"):
        program = read_program(text.replace(f'"{old}"', f'"{bad}"').encode(), None)
        with pytest.raises(ArtifactError, match=f"'{bad}', which clashes"):
            program.module(weights)


def test_model_parts_travel_with_the_nodes(tiny, dumped):
    """Each node keeps the model part the build decided (engine_dir/parts.py), so per-layer
    tools work on a loaded program; a part that is not a part name, or an index outside the
    table, is refused."""
    from dspark_compile.engine_dir.parts import node_part
    _, ep, weights = tiny
    program = read_program(*dumped)
    want = {n.name: node_part(n) for n in ep.graph.nodes if n.op == "call_function"}
    assert program.parts == want and {"layers.0", "mtp.0", "sampler", "head"} <= set(want.values())
    gm = program.module(weights)
    assert {n.name: n.meta["dspark_part"] for n in gm.graph.nodes
            if n.op == "call_function" and "dspark_part" in n.meta} == want
    doc = json.loads(dumped[0])
    for edit, says in ((lambda d: d["parts"].append("x'); import os"), "parts"),
                       (lambda d: d["nodes"][0].update(part=len(d["parts"])), "part")):
        bad = json.loads(dumped[0])
        edit(bad)
        with pytest.raises(ArtifactError, match=says):
            read_program(json.dumps(bad).encode(), dumped[1])
    assert doc["parts"]
