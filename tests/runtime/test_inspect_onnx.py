"""`dspark-compile inspect ENGINE --onnx OUT_DIR`: the tiny engine's smallest bucket as ONNX.

One export (`--bucket 1` of the `small_engine` fixture, CPU, ~1 min on 2 cores) is checked
from several sides: the files load and pass onnx.checker, every `dspark::` call of the stored
program is one node of the `dspark` domain (count per op, attributes, argument names), the
inputs keep the engine's state keys and each state write is an output. Bad input and a missing
optional dependency give one line naming the fix."""
import contextlib
import io
import json
import math
import re
import sys
import time
from collections import Counter

import pytest

from dspark_compile.cli.main import main
from dspark_compile.inspection.report import program_op_counts

onnx = pytest.importorskip("onnx", reason="the 'onnx' extra is not installed")
pytest.importorskip("onnxscript", reason="the 'onnx' extra is not installed")


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dspark-compile inspect: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def exported(small_engine, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("onnx") / "out"
    stdout, stderr = io.StringIO(), io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["inspect", str(small_engine.path), "--onnx", str(out_dir), "--bucket", "1"])
    seconds = time.perf_counter() - t
    assert rc == 0, stderr.getvalue()[-3000:]
    model = onnx.load(str(out_dir / "step_b1.onnx"), load_external_data=False)
    return {"dir": out_dir, "out": stdout.getvalue(), "model": model, "seconds": seconds}


def test_files_load_and_pass_the_checker_with_external_weights(exported):
    d = exported["dir"]
    assert sorted(p.name for p in d.iterdir() if p.suffix in (".onnx", ".data")) == \
        ["step_b1.onnx", "step_b1.onnx.data"]       # --bucket 1: bucket 2 is not exported
    onnx.checker.check_model(str(d / "step_b1.onnx"))   # the path form reads external data
    full = onnx.load(str(d / "step_b1.onnx"))           # weights come back from the .data file
    # every weight of 1024 elements or more lies in the .data file (onnx keeps tensors under
    # 1 KB inline: norm weights, mHC scales)
    inits = exported["model"].graph.initializer
    assert inits and all(i.data_location == onnx.TensorProto.EXTERNAL for i in inits
                         if math.prod(i.dims) >= 1024)
    ext = {e.key: e.value for i in inits for e in i.external_data if i.name == "model.embed.weight"}
    assert ext["location"] == "step_b1.onnx.data"
    assert any(i.name == "model.embed.weight" for i in full.graph.initializer)
    assert "[onnx] bucket 1:" in exported["out"] and "step_b1.onnx" in exported["out"]


def test_every_dspark_call_is_one_node_of_the_dspark_domain(exported, small_engine):
    model = exported["model"]
    want = program_op_counts(small_engine.path, small_engine.manifest["programs"]["1"]["path"])
    assert want and sum(want.values()) > 50
    got = Counter(n.op_type for n in model.graph.node if n.domain == "dspark")
    assert dict(got) == want
    assert {(o.domain, o.version) for o in model.opset_import} >= {("dspark", 1)}
    schemas = small_engine.manifest["dspark_ops"]
    for n in model.graph.node:
        if n.domain != "dspark":
            continue
        props = {p.key: p.value for p in n.metadata_props}
        assert n.doc_string == schemas[f"dspark::{n.op_type}.default"]
        assert len(props["dspark.outputs"].split(",")) == len(n.output)
        assert len(n.input) <= len(props["dspark.inputs"].split(","))
        assert sorted(a.name for a in n.attribute) == sorted(
            filter(None, props.get("dspark.attributes", "").split(",")))


def test_op_attributes_and_mutated_arguments(exported):
    nodes = {}
    for n in exported["model"].graph.node:
        if n.domain == "dspark":
            nodes.setdefault(n.op_type, n)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes["rmsnorm_quant"].attribute}
    assert set(attrs) == {"eps"} and 0 < attrs["eps"] < 1e-3
    mode = {a.name: onnx.helper.get_attribute_value(a)
            for a in nodes["rejection_sample"].attribute}["mode"]
    assert mode == b"full"          # the stored program's plan; greedy is a load-time variant
    qkv = nodes["qkv_postprocess"]
    props = {p.key: p.value for p in qkv.metadata_props}
    assert props["dspark.mutates"] == "cache_nope,cache_scale,cache_rope"
    assert props["dspark.outputs"] == "out0,cache_nope,cache_scale,cache_rope"
    assert len(qkv.output) == 4 and len(qkv.input) == 8


def test_state_inputs_keep_their_names_and_writes_are_outputs(exported, small_engine):
    placeholders = small_engine.manifest["programs"]["1"]["user_inputs"]
    names = [i.name for i in exported["model"].graph.input]
    assert names[0] == "rows" and len(names) == len(placeholders)
    for name, ph in zip(names[1:], placeholders[1:]):
        assert ph == "state_" + re.sub(r"\W", "_", name), (name, ph)
    assert "layers.3.swa_nope" in names and "row.last_pos" in names
    outs = [o.name for o in exported["model"].graph.output]
    updated = [o for o in outs if o.endswith(".updated")]
    assert {"layers.0.swa_nope.updated", "row.last_pos.updated", "row.tokens.updated"} <= set(
        updated)
    assert all(o[:-len(".updated")] in names for o in updated)
    assert outs[len(updated):] == ["output.0", "output.1"]
    print(f"onnx export of bucket 1: {exported['seconds']:.1f}s")


def test_tensorrt_report_or_its_skip_line(exported):
    from dspark_compile.inspection.tensorrt_report import tensorrt_version
    if tensorrt_version() is None:
        assert "[tensorrt] bucket 1: skipped (torch-tensorrt is not installed" in exported["out"]
        pytest.skip("torch-tensorrt is not installed (only on NVIDIA's package index: the "
                    "'tensorrt' extra)")
    rep = json.loads((exported["dir"] / "tensorrt_b1.json").read_text())
    assert rep["bucket"] == 1 and rep["subgraphs"]


def test_missing_onnxscript_names_the_extra(small_engine, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxscript", None)     # import onnxscript now fails
    assert main(["inspect", str(small_engine.path), "--onnx", str(tmp_path / "o")]) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert line.endswith("--onnx needs onnxscript: pip install 'dspark-compile[onnx]'"), line
    assert not (tmp_path / "o").exists()


def test_unknown_bucket_and_bucket_without_onnx(small_engine, tmp_path, capsys):
    assert main(["inspect", str(small_engine.path), "--onnx", str(tmp_path / "o"),
                 "--bucket", "3"]) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "--bucket 3: the engine has buckets [1, 2]" in line
    assert main(["inspect", str(small_engine.path), "--bucket", "1"]) == 1
    assert "--bucket selects what --onnx exports" in _one_line_error(capsys.readouterr().err)
