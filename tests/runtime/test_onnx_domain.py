"""The `dspark` ONNX domain as read from the registered ops' torch schemas (no export: the
tiny engine's export is tests/runtime/test_inspect_onnx.py)."""
import pytest
import torch

from dspark_compile.inspection.onnx_domain import DOMAIN, dspark_overloads, onnx_schema
from dspark_compile.inspection.onnx_functional import functional_twin, twin_schema

onnx = pytest.importorskip("onnx", reason="the 'onnx' extra is not installed")


def test_every_registered_op_has_an_onnx_schema():
    specs = dspark_overloads()
    assert {"qkv_postprocess", "context_kv_store", "rmsnorm_quant", "markov_sample"} <= set(specs)
    for name, spec in specs.items():
        s = onnx_schema(spec)
        assert (s.name, s.domain, s.since_version) == (name, DOMAIN, 1)
        assert [p.name for p in s.inputs] == [a.name for a in spec.inputs]
        assert [p.name for p in s.outputs] == spec.outputs
        assert sorted(s.attributes) == sorted(a.name for a in spec.attributes)


def test_mutated_arguments_become_outputs_of_a_functional_twin():
    spec = dspark_overloads()["qkv_postprocess"]
    assert spec.mutated == ["cache_nope", "cache_scale", "cache_rope"]
    assert spec.outputs == ["out0", "cache_nope", "cache_scale", "cache_rope"]
    assert twin_schema(spec) == (
        "qkv_postprocess(Tensor q, Tensor kv, Tensor positions, Tensor cos_sin, Tensor slots, "
        "Tensor cache_nope, Tensor cache_scale, Tensor cache_rope, float eps) "
        "-> (Tensor, Tensor, Tensor, Tensor)")
    store = dspark_overloads()["context_kv_store"]
    twin = functional_twin(store)
    assert twin is functional_twin(store)           # defined once per process
    assert str(twin._schema).endswith("-> Tensor") and not twin._schema.is_mutable


def test_dtype_and_optional_tensor_arguments():
    spec = dspark_overloads().get("fp8_linear")
    if spec is None:
        pytest.skip("no dspark::fp8_linear registered")
    types = {a.name: a.type for a in spec.args}
    assert types["x_s"] == "Tensor?" and types["out_dtype"] == "ScalarType"
    s = onnx_schema(spec)
    assert s.attributes["out_dtype"].type == onnx.defs.OpSchema.AttrType.STRING
    opt = onnx.defs.OpSchema.FormalParameterOption.Optional
    assert [p.option for p in s.inputs if p.name == "x_s"] == [opt]
    from dspark_compile.inspection.onnx_domain import _attribute
    assert _attribute(torch.bfloat16) == "bfloat16" and _attribute(True) == 1
