"""Find the annotated regions of `@fusable` reference calls and replace each by its `dspark::` op.

kernels/region.py marks every call of a decorated reference function while the step is exported:
each node the call created carries `meta["custom"][CALL]` (one id per call) and the op name; the
tensor arguments enter through `aten.alias` markers named after their parameter, the outputs
leave through markers numbered by their position. The fusion passes (passes/fuse_*.py) call
`fuse_regions(gm, ops)`, which per region

1. checks that the region can be replaced (`RegionError` with the reason otherwise, nothing
   changed): every argument of the op is bound (a marker or a recorded constant, by parameter
   name, or the schema default); no other node runs between its first and last node (export's
   metadata checks aside); no node inside is used outside except through an output marker;
   nothing inside reads a value from outside except through an argument marker (lifted
   constants excepted); every in-place write inside goes to an argument the op declares as
   mutated (`Tensor(a!)`), through views of its marker; the outputs match the op's fake
   results in number, shape and dtype;
2. inserts `torch.ops.dspark.<op>.default(args...)` where the region ends (regions are contiguous
   in the traced order, so the op's in-place writes happen where the reference's did), with
   `meta["val"]` from the op's fake implementation on the arguments' fake values, and one
   `getitem` per used output of a tuple-returning op;
3. points every use of an output marker at the new value and erases the region.

A region that fails a check stays as it is (the unfused reference, still correct) and the pass
warns (`RegionSkippedWarning`) and lists the reason in its notes.

Export copies a node's meta onto the `_assert_tensor_metadata` checks it inserts for the node's
consumers, so such checks may carry a region's annotation while sitting outside it: checks on
values inside the region go with it, checks on its outputs stay (their annotation is dropped).
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch.fx import Node

from dspark_compile.kernels import region as R

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.dce import eliminate_dead_code
from dspark_compile.passes.graph_utils import (
    ASSERT_OPS, alias_source, region_meta, strip_region_meta, written_args)

# meta keys copied from the region's last node onto the fused op (readable dumps, lint locations)
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "seq_nr")


class RegionError(ValueError):
    """A region cannot be replaced by its op; the message says why."""


class RegionSkippedWarning(UserWarning):
    """A fusion pass left a region unfused because it could not be replaced safely."""


@dataclass
class Region:
    op_name: str
    call: int
    nodes: list = field(default_factory=list)     # the region's nodes in graph order, no checks
    checks: list = field(default_factory=list)    # export's metadata checks with its annotation
    args: dict = field(default_factory=dict)      # parameter name -> argument marker
    outs: dict = field(default_factory=dict)      # output index -> output marker
    num_out: Optional[int] = None                 # -1: one bare tensor; None: no output marker
    consts: dict = field(default_factory=dict)
    tensor_args: list = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.op_name} region #{self.call} (ending at node '{self.nodes[-1].name}')"


def find_regions(graph: torch.fx.Graph, ops: Iterable[str]) -> list[Region]:
    """Every annotated region of the given op names, in graph order."""
    ops = set(ops)
    found: dict[int, Region] = {}
    for node in graph.nodes:
        c = region_meta(node)
        if not c or c.get(R.REGION) not in ops:
            continue
        reg = found.get(c[R.CALL])
        if reg is None:
            reg = found[c[R.CALL]] = Region(c[R.REGION], c[R.CALL],
                                            consts=dict(c.get(R.CONSTS, {})),
                                            tensor_args=list(c.get(R.TENSOR_ARGS, [])))
        if node.target in ASSERT_OPS:
            reg.checks.append(node)
            continue
        reg.nodes.append(node)
        if node.target is torch.ops.aten.alias.default:
            if R.ARG in c:
                reg.args[c[R.ARG]] = node
            elif R.OUT in c:
                reg.outs[c[R.OUT]] = node
                reg.num_out = c.get(R.NUM_OUT)
    return [r for r in found.values() if r.nodes]


def _op(name: str):
    packet = getattr(torch.ops.dspark, name, None)
    if packet is None:
        raise RegionError(f"dspark::{name} is not registered (import its kernel module)")
    return packet.default


def _bind(reg: Region, schema) -> list:
    """The op's positional arguments, bound by parameter name."""
    names = [a.name for a in schema.arguments]
    unknown = sorted((set(reg.args) | set(reg.consts)) - set(names))
    if unknown:
        raise RegionError(f"{reg.where}: the op has no parameter(s) {unknown}: {schema}")
    missing = [k for k in reg.tensor_args if k not in reg.args]
    if missing:
        raise RegionError(f"{reg.where}: argument marker(s) {missing} are gone (removed by an "
                          "earlier pass?)")
    out = []
    for a in schema.arguments:
        if a.name in reg.args:
            out.append(reg.args[a.name].args[0])
        elif a.name in reg.consts:
            v = reg.consts[a.name]
            out.append(float(v) if isinstance(a.type, torch.FloatType) and isinstance(v, int)
                       and not isinstance(v, bool) else v)
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise RegionError(f"{reg.where}: nothing binds the op's argument '{a.name}'")
    return out


def _check_contiguous(reg: Region, members: set) -> None:
    """Nothing else runs between the region's first and last node (export's checks aside), so
    the op may do all of the region's work, its in-place writes included, where it ends."""
    n = reg.nodes[0]
    while n is not reg.nodes[-1]:
        n = n.next
        if n not in members and n.target not in ASSERT_OPS:
            raise RegionError(f"{reg.where}: node '{n.name}' of the rest of the graph runs inside "
                              "the region")


def _check_closed(reg: Region, members: set, user_inputs: frozenset) -> None:
    """Values cross the region's boundary only through its markers (lifted constants aside: a
    tensor literal inside a reference becomes a placeholder of the program, not a user input)."""
    outs = set(reg.outs.values())
    args = set(reg.args.values())
    for n in reg.nodes:
        if n not in outs:
            leak = [u for u in n.users if u not in members and u not in reg.checks]
            if leak:
                raise RegionError(f"{reg.where}: node '{n.name}' is used outside the region by "
                                  f"'{leak[0].name}' without an output marker")
        if n not in args:
            for i in n.all_input_nodes:
                # a symbolic size (a program exported for every batch size reads the sizes
                # that build/dynamic_batch.py hoisted above every region): the op derives it
                # from its arguments' shapes, nothing flows through it
                constant = i.op == "get_attr" or (i.op == "placeholder"
                                                   and i.name not in user_inputs) or (
                    i.op == "call_function" and isinstance(
                        i.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat)))
                if i not in members and not constant:
                    raise RegionError(f"{reg.where}: node '{n.name}' reads '{i.name}' from outside "
                                      "the region without an argument marker")


def _check_writes(reg: Region, members: set, schema) -> None:
    """In-place writes inside go to arguments the op declares as written, through their marker."""
    marker_of = {m: k for k, m in reg.args.items()}
    mutated = {a.name for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
    for n in reg.nodes:
        for w in written_args(n):
            seen = set()
            while w in members and w not in marker_of and w not in seen:
                seen.add(w)
                src = alias_source(w)
                if src is None:
                    break          # a temporary the region allocated itself
                w = src
            if w in marker_of and marker_of[w] not in mutated:
                raise RegionError(f"{reg.where}: node '{n.name}' writes argument "
                                  f"'{marker_of[w]}', which the op does not declare as mutated")
            if w not in members:
                raise RegionError(f"{reg.where}: node '{n.name}' writes '{w.name}', which is "
                                  "not an argument of the region")


def _fake_outputs(reg: Region, op, args: list) -> list:
    """The op's outputs on the arguments' fake values (meta['val'] of the inserted nodes)."""
    vals = [a.meta.get("val") if isinstance(a, Node) else a for a in args]
    if any(isinstance(a, Node) and not isinstance(v, torch.Tensor) for a, v in zip(args, vals)):
        raise RegionError(f"{reg.where}: an argument has no meta['val']")
    mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        raise RegionError(f"{reg.where}: the arguments' meta['val'] are not fake tensors")
    with mode:
        out = op(*vals)
    outs = [] if out is None else [out] if isinstance(out, torch.Tensor) else list(out)
    bare = isinstance(out, torch.Tensor)
    if reg.num_out is not None and reg.num_out != (-1 if bare else len(outs)):
        got = "one tensor" if bare else len(outs)
        raise RegionError(f"{reg.where}: the reference returned {reg.num_out} output(s) "
                          f"(-1 = one tensor), the op returns {got}")
    for j, m in reg.outs.items():
        ref = m.meta.get("val")
        got = outs[j] if j < len(outs) else None
        if not isinstance(ref, torch.Tensor) or got is None or tuple(ref.shape) != tuple(
                got.shape) or ref.dtype != got.dtype:
            raise RegionError(f"{reg.where}: output {j} of the op does not match the "
                              f"reference's ({getattr(got, 'shape', None)}/"
                              f"{getattr(got, 'dtype', None)} vs {getattr(ref, 'shape', None)}/"
                              f"{getattr(ref, 'dtype', None)})")
    return outs if not bare else [out]



def fuse_region(gm: torch.fx.GraphModule, reg: Region,
                user_inputs: frozenset = frozenset()) -> Node:
    """Replace one region by its op (after checking it can be); returns the op's node.
    `user_inputs`: placeholder names the region may only read through argument markers."""
    graph = gm.graph
    op = _op(reg.op_name)
    schema = op._schema
    members = set(reg.nodes)
    args = _bind(reg, schema)
    _check_contiguous(reg, members)
    _check_closed(reg, members, user_inputs)
    _check_writes(reg, members, schema)
    outs = _fake_outputs(reg, op, args)
    bare = reg.num_out == -1 or (len(schema.returns) == 1 and reg.num_out is None)

    last = reg.nodes[-1]
    with graph.inserting_after(last):
        fused = graph.call_function(op, tuple(args))
    fused.meta.update({k: last.meta[k] for k in _KEPT_META if k in last.meta})
    fused.meta["val"] = (outs[0] if bare else tuple(outs)) if outs else None
    fused.meta["custom"] = {"dspark_fused": reg.op_name}  # which region it replaced (dumps)
    prev = fused
    for j, marker in sorted(reg.outs.items()):
        if bare:
            value = fused
        else:
            with graph.inserting_after(prev):
                value = prev = graph.call_function(operator.getitem, (fused, j))
            value.meta.update({k: fused.meta[k] for k in _KEPT_META if k in fused.meta})
            value.meta["val"] = outs[j]
        marker.replace_all_uses_with(value)

    for chk in reg.checks:  # checks on values that no longer exist go with them
        if any(i in members for i in chk.all_input_nodes):
            graph.erase_node(chk)
        else:
            strip_region_meta(chk.meta)
    for n in reversed(reg.nodes):
        graph.erase_node(n)
    return fused


def fuse_regions(gm: torch.fx.GraphModule, ops: Iterable[str], ctx=None) -> PassResult:
    """Replace every region of `ops` (op names) by its op. `ctx.options()["ops"]` may restrict
    the set (leave an op to the unfused graph); a region that cannot be replaced is left as it
    is and reported in the notes. Returns the number of regions replaced."""
    ops = list(ops)
    opts = ctx.options() if ctx is not None else {}
    if "ops" in opts:
        unknown = sorted(set(opts["ops"]) - set(ops))
        if unknown:
            raise ValueError(f"option 'ops' of this pass: unknown op(s) {unknown}; "
                             f"it fuses {ops}")
        ops = [o for o in ops if o in set(opts["ops"])]
    ep = getattr(ctx, "exported_program", None)
    user_inputs = frozenset(ep.graph_signature.user_inputs) if ep is not None else frozenset()
    per_op = {o: 0 for o in ops}
    skipped = []
    for reg in find_regions(gm.graph, ops):
        try:
            fuse_region(gm, reg, user_inputs)
        except RegionError as e:
            skipped.append(str(e))
            continue
        per_op[reg.op_name] += 1
    if skipped:
        warnings.warn(f"{len(skipped)} region(s) left unfused: " + "; ".join(skipped),
                      RegionSkippedWarning, stacklevel=2)
    if any(per_op.values()):
        eliminate_dead_code(gm.graph)
    return PassResult(sum(per_op.values()), notes={"fused": per_op, "skipped": skipped})
