"""The `dspark` ONNX domain: one custom-domain node per `dspark::` op.

Every `dspark::` op (kernels/registry.py) becomes a node `dspark.<op>` (opset 1) whose inputs are
the op's tensor arguments in schema order and whose attributes are its other arguments (floats,
ints, strings, bools as ints, lists), named as in the torch schema. An op that mutates arguments
(a cache store) becomes a node with one more output per mutated argument, its new value:
ONNX has no in-place updates, so the state a step writes is an output of the graph
(dspark_compile/inspection/onnx_functional.py rewrites the program that way before export).

Each node carries its torch schema as `doc_string` and, in `metadata_props`, the names of its
inputs (`dspark.inputs`), outputs (`dspark.outputs`), attributes and mutated arguments, so
Netron shows what every position means. The ONNX schema built here is also what the exporter's
tracer checks a call against; it is not registered with onnx globally.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from dspark_compile.engine_dir.format import register_kernel_ops
from dspark_compile.kernels.registry import KERNELS

DOMAIN = "dspark"
DOMAIN_VERSION = 1

# torch schema type (str) -> ONNX attribute type name (onnx.defs.OpSchema.AttrType member); a
# dtype argument is its torch name ("bfloat16")
_ATTR_TYPES = {"float": "FLOAT", "int": "INT", "SymInt": "INT", "bool": "INT", "str": "STRING",
               "ScalarType": "STRING", "float[]": "FLOATS", "int[]": "INTS", "SymInt[]": "INTS",
               "str[]": "STRINGS", "bool[]": "INTS"}


@dataclass(frozen=True)
class Arg:
    name: str
    type: str            # the torch schema's spelling: "Tensor", "Tensor?", "float", "str", ...
    tensor: bool
    mutated: bool
    default: object = None
    has_default: bool = False


@dataclass(frozen=True)
class OpSpec:
    """One `dspark::` op as the ONNX node sees it."""
    name: str            # the op's name, e.g. "qkv_postprocess" (also the ONNX op_type)
    overload: object     # torch.ops.dspark.<name>.default
    args: tuple          # of Arg, in schema order
    returns: int         # the op's own outputs (a mutated argument's new value comes after)

    @property
    def inputs(self) -> list:
        return [a for a in self.args if a.tensor]

    @property
    def attributes(self) -> list:
        return [a for a in self.args if not a.tensor]

    @property
    def mutated(self) -> list:
        return [a.name for a in self.args if a.mutated]

    @property
    def outputs(self) -> list:
        """Output names: `out{i}` for the op's returns, then each mutated argument's name."""
        return [f"out{i}" for i in range(self.returns)] + self.mutated

    @property
    def schema(self) -> str:
        return str(self.overload._schema)

    def bind(self, args, kwargs) -> dict:
        """name -> value for a call `op(*args, **kwargs)` (schema defaults filled in)."""
        if len(args) > len(self.args):
            raise TypeError(f"dspark::{self.name} takes {len(self.args)} arguments, "
                            f"got {len(args)}")
        out = {a.name: v for a, v in zip(self.args, args)}
        for a in self.args[len(args):]:
            if a.name in kwargs:
                out[a.name] = kwargs[a.name]
            elif a.has_default:
                out[a.name] = a.default
            else:
                raise TypeError(f"dspark::{self.name}: argument '{a.name}' missing")
        return out


def _spell(t) -> str:
    """A schema type as a schema string spells it ("Tensor?", "int[]", "ScalarType")."""
    if isinstance(t, torch.OptionalType):
        return _spell(t.getElementType()) + "?"
    if isinstance(t, torch.ListType):
        return _spell(t.getElementType()) + "[]"
    return str(t)


def op_spec(overload) -> OpSpec:
    """The OpSpec of a `dspark::` op overload, read from its torch schema."""
    s = overload._schema
    args = []
    for a in s.arguments:
        # real_type: `type` says int for SymInt and ScalarType
        spelled = _spell(getattr(a, "real_type", a.type))
        tensor = spelled in ("Tensor", "Tensor?")
        if not tensor and spelled.rstrip("?") not in _ATTR_TYPES:
            raise NotImplementedError(f"dspark::{s.name} argument '{a.name}' has type "
                                      f"{spelled}, which has no ONNX attribute type here")
        args.append(Arg(a.name, spelled, tensor, bool(a.alias_info and a.alias_info.is_write),
                        a.default_value if a.has_default_value() else None,
                        a.has_default_value()))
    for r in s.returns:
        if str(r.type) != "Tensor":
            raise NotImplementedError(f"dspark::{s.name} returns {r.type}; only tensors map "
                                      "to ONNX outputs here")
    return OpSpec(s.name.split("::", 1)[-1], overload, tuple(args), len(s.returns))


def dspark_overloads() -> dict:
    """op name -> OpSpec for every registered `dspark::` op (the kernels are imported)."""
    register_kernel_ops()
    return {name: op_spec(k.op.default) for name, k in sorted(KERNELS.items())}


def _tensor_types() -> list:
    # every tensor type ONNX knows: Identity accepts all of them
    import onnx
    ident = onnx.defs.get_schema("Identity")
    return [t for c in ident.type_constraints for t in c.allowed_type_strs
            if t.startswith("tensor(")]


def onnx_schema(spec: OpSpec):
    """The onnx.defs.OpSchema of `dspark.<op>`: each input and output its own type variable."""
    import onnx
    S = onnx.defs.OpSchema
    types = _tensor_types()
    inputs = [S.FormalParameter(a.name, f"T_{a.name}",
                                param_option=S.FormalParameterOption.Optional
                                if a.type.endswith("?") else S.FormalParameterOption.Single)
              for a in spec.inputs]
    outputs = [S.FormalParameter(n, f"O_{n}") for n in spec.outputs]
    constraints = [(p.type_str, types, "any tensor") for p in inputs + outputs]
    attrs = [S.Attribute(a.name, getattr(S.AttrType, _ATTR_TYPES[a.type.rstrip("?")]),
                         "", required=not a.has_default) for a in spec.attributes]
    return S(spec.name, DOMAIN, DOMAIN_VERSION, spec.schema, inputs=inputs, outputs=outputs,
             type_constraints=constraints, attributes=attrs)


def _attribute(value):
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (list, tuple)):
        return [int(v) if isinstance(v, bool) else v for v in value]
    return value


def translation(spec: OpSpec):
    """The torch.onnx custom translation of `spec`: records one `dspark.<op>` node."""
    import onnxscript
    from onnxscript import values

    op = values.Op(onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION), spec.name, onnx_schema(spec))

    def translate(*args, **kwargs):
        bound = spec.bind(args, kwargs)
        attrs = {a.name: _attribute(bound[a.name]) for a in spec.attributes
                 if bound[a.name] is not None}
        outs = op(*[bound[a.name] for a in spec.inputs], **attrs)
        seq = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        node = seq[0].producer()
        node.doc_string = spec.schema
        props = {"dspark.inputs": [a.name for a in spec.inputs], "dspark.outputs": spec.outputs,
                 "dspark.attributes": [a.name for a in spec.attributes],
                 "dspark.mutates": spec.mutated}
        node.metadata_props.update({k: ",".join(v) for k, v in props.items() if v})
        return outs

    translate.__name__ = f"dspark_{spec.name}_to_onnx"
    return translate
