"""Schema-driven facts about FX nodes that every pass needs: views, writes, side effects.

Everything is read from the operator schema (`Tensor(a!)` = written, `Tensor(a)` return = view),
so custom `dspark::` ops declared with `mutates_args` are handled like `aten.index_copy_`.
Anything whose schema we cannot read (higher-order ops, unknown callables) is treated as
writing every tensor argument: a wrong "pure" answer would let a pass delete a cache update.
"""
from __future__ import annotations

import operator
from typing import Iterable, Optional

import torch
from torch.fx import Node

from dspark_compile.kernels import region as _region

aten = torch.ops.aten

# Known pure Python callables that appear in exported graphs (symbolic shape arithmetic).
_PURE_CALLABLES = {operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
                   operator.truediv, operator.mod, operator.neg, operator.pow, operator.eq,
                   operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
                   operator.and_, operator.or_, operator.not_}
_PURE_CALLABLES |= {f for f in (getattr(torch, n, None) for n in (
    "sym_max", "sym_min", "sym_not", "sym_float", "sym_int", "sym_sqrt", "sym_ite")) if f}


def _op(name: str, overload: str = "default"):
    packet = getattr(aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


# Nodes whose only job is a runtime check: no value, but removing them is a decision
# (remove_asserts makes it), never something DCE does by accident.
ASSERT_OPS = tuple(o for o in (
    _op("_assert_scalar"), _op("_assert_tensor_metadata"), _op("sym_constrain_range"),
    _op("sym_constrain_range_for_size"), _op("_assert_async"), _op("_assert_async", "msg"),
    _op("_functional_assert_async", "msg"), _op("_functional_sym_constrain_range"),
    _op("_functional_sym_constrain_range_for_size"), _op("_functional_assert_scalar"),
) if o is not None)


def schema_of(node: Node):
    t = node.target
    return t._schema if isinstance(t, torch._ops.OpOverload) else None


def op_name(node: Node) -> str:
    """'aten.index_copy_.default' / 'dspark.moe_experts.default' / the callable's name."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    return getattr(t, "__name__", str(t))


def packet_name(node: Node) -> str:
    """'aten::index_copy_' for an OpOverload (overload-independent), '' otherwise."""
    s = schema_of(node)
    return s.name if s is not None else ""


def _bound_args(node: Node):
    """[(schema argument, value)] for the node's positional and keyword arguments."""
    s = schema_of(node)
    out = []
    for i, a in enumerate(s.arguments):
        if a.kwarg_only or i >= len(node.args):
            if a.name in node.kwargs:
                out.append((a, node.kwargs[a.name]))
        else:
            out.append((a, node.args[i]))
    return out


def _nodes_in(value) -> list[Node]:
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes_in(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _nodes_in(v)]
    return []


def written_args(node: Node) -> list[Node]:
    """Input nodes this node writes in place (schema `Tensor(a!)`)."""
    if node.op != "call_function":
        return [] if node.op in ("placeholder", "output", "get_attr") else _nodes_in(node.args)
    s = schema_of(node)
    if s is None:
        if node.target in _PURE_CALLABLES:
            return []
        return _nodes_in(node.args) + _nodes_in(node.kwargs)  # unknown: assume it writes
    out = []
    for a, v in _bound_args(node):
        if a.alias_info is not None and a.alias_info.is_write:
            out.extend(_nodes_in(v))
    return out


def is_view(node: Node) -> bool:
    """The node's output aliases an input without writing it (view / `to` that may alias /
    `getitem` of a view op's list output)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, Node) and src.op == "call_function" and is_view(src)
    s = schema_of(node)
    if s is None or len(s.returns) != 1:
        return False
    ai = s.returns[0].alias_info
    return ai is not None and not ai.is_write


def is_inplace_alias(node: Node) -> bool:
    """Output is the written argument itself (`index_copy_`, `copy_`, ...)."""
    s = schema_of(node)
    if s is None or len(s.returns) != 1:
        return False
    ai = s.returns[0].alias_info
    return ai is not None and ai.is_write


# Ops whose schema says "new tensor" but which return a view at run time.
_RUNTIME_VIEWS = {"aten::_unsafe_view", "aten::_reshape_alias"}


def arg_value(node: Node, name: str, default=None):
    """The value bound to schema argument `name` (positional or keyword)."""
    s = schema_of(node)
    if s is None:
        return node.kwargs.get(name, default)
    for a, v in _bound_args(node):
        if a.name == name:
            return v
    for a in s.arguments:  # not passed: the schema's default
        if a.name == name and a.has_default_value():
            return a.default_value
    return default


def alias_source(node: Node) -> Optional[Node]:
    """The input node this node's output aliases (views and in-place ops), else None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return alias_source(node.args[0]) if is_view(node) else None
    s = schema_of(node)
    if s is not None and s.name in _RUNTIME_VIEWS:
        return node.args[0] if isinstance(node.args[0], Node) else None
    if s is None or len(s.returns) != 1 or s.returns[0].alias_info is None:
        return None
    ret_sets = set(s.returns[0].alias_info.before_set)
    for a, v in _bound_args(node):
        if a.alias_info is not None and set(a.alias_info.before_set) & ret_sets:
            ns = _nodes_in(v)
            return ns[0] if ns else None
    return None


def alias_root(node: Node) -> Node:
    """Walk view / in-place chains up to the node that owns the storage."""
    seen = set()
    while node not in seen:
        seen.add(node)
        src = alias_source(node)
        if src is None:
            return node
        node = src
    return node


def alias_classes(graph: torch.fx.Graph) -> dict[Node, set]:
    """root -> every node sharing its storage (itself, views, in-place results)."""
    classes: dict[Node, set] = {}
    for n in graph.nodes:
        classes.setdefault(alias_root(n), set()).add(n)
    return classes


def written_roots(graph: torch.fx.Graph) -> set:
    """Storage roots that some node writes in place."""
    return {alias_root(w) for n in graph.nodes for w in written_args(n)}


def is_random(node: Node) -> bool:
    """Draws from torch's stateful RNG (tag nondeterministic_seeded), unless the op's only
    randomness is a dropout that is switched off (p == 0 / train=False), as in SDPA."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in t.tags:
        return False
    names = {a.name for a in t._schema.arguments}
    if "dropout_p" in names:                                 # attention kernels
        return arg_value(node, "dropout_p", 0.0) not in (0, 0.0)
    if "dropout" in t._schema.name and "p" in names:         # dropout / native_dropout
        return arg_value(node, "p") not in (0, 0.0) and arg_value(node, "train", True) is not False
    return True


def has_side_effects(node: Node) -> bool:
    """True when deleting the node (even with no users) could change behaviour."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op != "call_function":
        return True  # get_attr / call_module: not ours to delete
    if node.target in ASSERT_OPS or written_args(node) or is_random(node):
        return True
    s = schema_of(node)
    if s is not None and s.is_mutable:
        return True
    if s is None and node.target not in _PURE_CALLABLES:
        return True
    try:
        return bool(node.is_impure())
    except Exception:  # pragma: no cover - torch version differences
        return False


def tensor_val(node) -> Optional[torch.Tensor]:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def vals_of(node: Node) -> list[torch.Tensor]:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


def same_shape(a, b) -> bool:
    """Statically equal sizes (symbolic sizes compared without guarding)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
            continue
        try:
            from torch.fx.experimental.symbolic_shapes import statically_known_true
            if not statically_known_true(x == y):
                return False
        except Exception:
            return False
    return True


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Indistinguishable tensors as far as any consumer can tell (size, stride, offset, dtype,
    device)."""
    if a.dtype != b.dtype or a.device != b.device or a.layout != b.layout:
        return False
    if not same_shape(a.shape, b.shape):
        return False
    if a.layout != torch.strided:
        return True
    try:
        return same_shape(a.stride(), b.stride()) and same_shape(
            [a.storage_offset()], [b.storage_offset()])
    except Exception:
        return False


def graph_outputs(graph: torch.fx.Graph) -> list[Node]:
    out = graph.output_node() if hasattr(graph, "output_node") else \
        next(n for n in reversed(graph.nodes) if n.op == "output")
    return _nodes_in(out.args)


def replace_node(old: Node, new: Node) -> None:
    """Point every user of `old` at `new` and erase `old`."""
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def source_location(node: Node) -> str:
    """'File "x.py", line 12, in forward: k = n.item()' from node.meta['stack_trace']."""
    st = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}: {code}" if code else lines[i]
    return "<no source location: node has no stack_trace>"


def node_count(graph: torch.fx.Graph) -> int:
    return len(graph.nodes)


def iter_call_nodes(graph: torch.fx.Graph, targets: Iterable = None):
    ts = set(targets) if targets is not None else None
    for n in list(graph.nodes):
        if n.op == "call_function" and (ts is None or n.target in ts):
            yield n


def region_meta(node: Node) -> dict:
    """The fusable-region annotation of a node (kernels/region.py), {} when it has none."""
    c = node.meta.get("custom")
    return c if isinstance(c, dict) and _region.CALL in c else {}


def strip_region_meta(meta: dict) -> None:
    """Remove the fusable-region annotation (the "dspark_*" keys) from a node's meta, in place."""
    c = meta.get("custom")
    if isinstance(c, dict):
        kept = {k: v for k, v in c.items() if not k.startswith("dspark_")}
        if kept:
            meta["custom"] = kept
        else:
            meta.pop("custom")


def is_region_marker(node: Node) -> bool:
    """An argument or output marker of a fusable region: an `aten.alias` the cleanup passes keep,
    because the fusion pass reads the region's signature from it (kernels/region.py)."""
    c = region_meta(node)
    return bool(c) and (_region.ARG in c or _region.OUT in c) and node.target is aten.alias.default
