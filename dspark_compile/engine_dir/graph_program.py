"""A program of the engine's format, read and checked (engine_dir/graph_read.py
`read_program`): `GraphProgram` holds its inputs, nodes and outputs as checked data and builds
from them alone the module `ep.module()` would (`module`), binds the engine's weights to it,
and traces it again for tools (`exported`); the runner of the engine's calls is
engine_dir/graph_run.py's. Nothing here reads a file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch.utils import _pytree as pytree

from dspark_compile.engine_dir.format import ArtifactError

def _refuse(rel: str, why: str) -> ArtifactError:
    return ArtifactError(f"program '{rel}' is refused: {why} (a program is a graph of aten, "
                         "prims and dspark ops over typed literals, nothing a load executes)",
                         path=rel)


class _Ref:
    """A reference to a placeholder or an earlier node, by name (resolved per module)."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


@dataclass
class _Input:
    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple
    target: Optional[str] = None
    stored: Optional[str] = None
    persistent: bool = True


class GraphProgram:
    """A program read and checked (read_program); `module(weights)` builds its runnable module."""

    def __init__(self, rel, arg_names, in_spec, out_spec, inputs, nodes, outputs, constants):
        self.rel, self.arg_names = rel, arg_names
        self.in_spec, self.out_spec = in_spec, out_spec
        self.inputs: list[_Input] = inputs
        self.nodes: list[tuple] = nodes          # (name, op, args, kwargs)
        self.outputs: list[tuple] = outputs      # (kind, target, value)
        self.constants: dict = constants
        self.sizes: dict = {}        # symbol -> (min, max) of a program with dynamic sizes
        self.parts: dict = {}        # node name -> its model part (engine_dir/parts.py)
        self.weights: Optional[Mapping[str, torch.Tensor]] = None     # bind()

    def bind(self, weights: Mapping[str, torch.Tensor]) -> "GraphProgram":
        """Keep `weights` (the engine's, shared by its programs) as the tensors `module()`
        lifts, each checked now (present, its dtype and shape); returns self."""
        for i in self.inputs:
            if i.kind != "user":
                self._lifted(i, weights)
        self.weights = weights
        return self

    def lifted(self) -> list:
        """The lifted tensors in input order (weights, then constants as they come), as a
        compiled program's leading inputs take them (runtime/inductor.py)."""
        return [self._lifted(i, self._bound()) for i in self.inputs if i.kind != "user"]

    def _bound(self) -> Mapping[str, torch.Tensor]:
        if self.weights is None:
            raise ValueError(f"program '{self.rel}' is not bound to weights (bind())")
        return self.weights

    @property
    def state_keys(self) -> Optional[list]:
        """The state dict's keys in order, for a (first, state) program; else None."""
        args = self.in_spec.child(0)
        if args.num_children == 2 and args.child(1).type is dict:
            return list(args.child(1).context)
        return None

    @property
    def state_meta(self) -> dict:
        """{state key: (dtype, shape)} of a (first, state) program's state inputs, what
        fields.py check_programs_state compares with the manifest's configs; {} otherwise."""
        keys = self.state_keys or []
        users = [i for i in self.inputs if i.kind == "user"][1:]
        return {k: (i.dtype, i.shape) for k, i in zip(keys, users)}

    @property
    def weight_names(self) -> list:
        """The names this program takes from the engine's weights, in input order."""
        return [i.target for i in self.inputs if i.stored == "weights"]

    def module(self, weights: Optional[Mapping[str, torch.Tensor]] = None,
               validate_inputs: bool = True, nested: bool = False) -> torch.fx.GraphModule:
        """A fresh module `fn(*args)` running the program, as `ep.module()` would: its lifted
        tensors are `weights[target]` (default: the bound weights; the same tensor objects,
        never copied) or the program's constants; a user input or buffer the graph mutates gets
        the copy_ ep.module() inserts. With `validate_inputs` each call checks its arguments'
        structure, shapes and dtypes. The lifted tensors are flat attributes named as their
        placeholders, or with `nested` submodules named as the weights are (ep.module()'s
        layout, for tools that show the names: the ONNX export; ~500 nn.Modules a tiny step)."""
        from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

        weights = self._bound() if weights is None else weights

        root = torch.nn.Module()
        graph = torch.fx.Graph()
        env = {}
        for i in self.inputs:
            if i.kind == "user":
                env[i.name] = graph.placeholder(i.name)
                continue
            # a flat attribute named as the placeholder: no submodule per dotted name (a
            # tiny step's ~370 lifted tensors made ~500 nn.Modules, 40 % of its module's build)
            attr = i.target if nested else i.name
            _assign(root, i, self._lifted(i, weights), self.rel, attr)
            env[i.name] = graph.get_attr(attr)
        for name, op, args, kwargs in self.nodes:
            env[name] = graph.create_node("call_function", op, _resolve(args, env),
                                          _resolve(kwargs, env), name=name)
            if name in self.parts:
                env[name].meta["dspark_part"] = self.parts[name]
        users, copies = [], {}
        for kind, target, value in self.outputs:
            value = _resolve(value, env)
            if kind == "user":
                users.append(value)
            else:
                dest = env[target] if kind == "user_input_mutation" else env[self._lifted_name(
                    target)]
                copies[value] = graph.call_function(torch.ops.aten.copy_.default, (dest, value))
        graph.output(tuple(copies.get(v, v) if isinstance(v, torch.fx.Node) else v
                           for v in users))
        graph._codegen = _PyTreeCodeGen(_PyTreeInfo(list(self.arg_names), self.in_spec,
                                                    self.out_spec))
        gm = torch.fx.GraphModule(root, graph)
        gm.validate_inputs = validate_inputs
        gm.register_forward_pre_hook(_InputCheck(self), with_kwargs=True)
        return gm

    def exported(self, sizes: Optional[dict] = None) -> torch.export.ExportedProgram:
        """The program as a static torch.export program again (for tools that take one: the
        ONNX export, dspark_compile/inspection/), traced from `module()` on example inputs of
        its shapes and dtypes (their values are never read: export traces with fake tensors).
        `sizes`: the value of each dynamic size (default: its range's maximum)."""
        at = {k: hi for k, (_, hi) in self.sizes.items()}
        at.update(sizes or {})
        users = [i for i in self.inputs if i.kind == "user"]
        device = next((t.device for t in self.lifted()), torch.device("cpu"))
        args, _ = pytree.tree_unflatten(
            [torch.zeros([at[d] if isinstance(d, str) else d for d in i.shape], dtype=i.dtype,
                         device=device) for i in users], self.in_spec)
        with torch.no_grad():
            return torch.export.export(self.module(validate_inputs=False, nested=True),
                                       tuple(args), strict=False)

    def _lifted_name(self, target: str) -> str:
        return next(i.name for i in self.inputs if i.target == target)

    def _lifted(self, i: _Input, weights: Mapping) -> torch.Tensor:
        src = weights if i.stored == "weights" else self.constants
        t = src.get(i.target) if hasattr(src, "get") else None
        what = "the engine's weights" if i.stored == "weights" else "its constants"
        if not isinstance(t, torch.Tensor):
            raise _refuse(self.rel, f"it takes '{i.target}' from {what}, which hold no such "
                                    "tensor")
        if t.dtype != i.dtype or tuple(t.shape) != i.shape:
            raise _refuse(self.rel, f"it expects '{i.target}' as {i.dtype} {list(i.shape)}, "
                                    f"{what} hold {t.dtype} {list(t.shape)}")
        return t


def _resolve(v, env):
    if isinstance(v, _Ref):
        return env[v.name]
    if isinstance(v, list):
        return [_resolve(x, env) for x in v]
    if isinstance(v, tuple):
        return tuple(_resolve(x, env) for x in v)
    if isinstance(v, dict):
        return {k: _resolve(x, env) for k, x in v.items()}
    return v


def _assign(root: torch.nn.Module, i: _Input, t: torch.Tensor, rel: str, attr: str) -> None:
    """`t` as root's attribute `attr` (the input's name, or its dotted tensor name: submodules
    made on the way), registered as ep.module() registers it (a parameter, a buffer, or a plain
    constant); a name that clashes with a module attribute or another tensor is refused."""
    *path, leaf = attr.split(".")
    mod = root
    try:
        for p in path:
            if p in mod._buffers or p in mod._parameters:
                raise KeyError(p)
            sub = mod._modules.get(p)
            if sub is None:
                if hasattr(mod, p) or p in _RESERVED:
                    raise KeyError(p)
                sub = torch.nn.Module()
                mod.add_module(p, sub)
            mod = sub
        if leaf in _RESERVED or hasattr(mod, leaf):
            raise KeyError(leaf)
        if i.kind == "parameter":
            mod.register_parameter(leaf, t if isinstance(t, torch.nn.Parameter)
                                   else torch.nn.Parameter(t, requires_grad=False))
        elif i.kind == "buffer":
            mod.register_buffer(leaf, t, persistent=i.persistent)
        else:
            setattr(mod, leaf, t)
    except KeyError as e:
        raise _refuse(rel, f"its input '{attr}' is named {e.args[0]!r}, which clashes with a "
                           "module attribute or another tensor") from None


# attributes a GraphModule has beyond nn.Module's (its graph, code, meta ...)
_RESERVED = frozenset(dir(torch.fx.GraphModule)) | {"graph", "code", "meta", "_graph", "_code",
                                                   "_in_spec", "_out_spec", "validate_inputs"}


class _InputCheck:
    """forward pre-hook: the call's arguments have the program's structure (dict keys in any
    order, as ep.module() allows), and every tensor its placeholder's shape and dtype."""

    def __init__(self, program: GraphProgram):
        self.spec = program.in_spec
        self.sizes = program.sizes
        self.users = [i for i in program.inputs if i.kind == "user"]
        self.n = program.in_spec.child(0).num_children

    def __call__(self, module, args, kwargs):
        if not getattr(module, "validate_inputs", True):
            return
        if kwargs or len(args) != self.n:
            raise TypeError(f"the program takes {self.n} positional arguments, got {len(args)}"
                            + (f" and keywords {sorted(kwargs)}" if kwargs else ""))
        _, got = pytree.tree_flatten((tuple(args), {}))
        if not _same_structure(got, self.spec):
            raise ValueError(f"the program's inputs are {self.spec}, got {got}")
        from torch.fx._pytree import tree_flatten_spec
        bound: dict = {}             # a size's value in this call: the same in every input
        for i, x in zip(self.users, tree_flatten_spec((list(args), {}), self.spec)):
            ok = isinstance(x, torch.Tensor) and x.dtype == i.dtype and x.dim() == len(i.shape)
            for have, want in zip(x.shape if ok else (), i.shape):
                if isinstance(want, str):
                    lo, hi = self.sizes[want]
                    ok = ok and lo <= have <= hi and bound.setdefault(want, have) == have
                else:
                    ok = ok and have == want
            if not ok:
                have = (f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor)
                        else type(x).__name__)
                raise ValueError(f"input '{i.name}' must be {i.dtype} {list(i.shape)}"
                                 + "".join(f" ({k} in [{lo}, {hi}])"
                                           for k, (lo, hi) in self.sizes.items()
                                           if k in i.shape)
                                 + f", got {have}")


def _same_structure(a, b) -> bool:
    """TreeSpec equality with dict keys in any order (torch.export's eq_spec)."""
    if a.is_leaf() or b.is_leaf():
        return a.is_leaf() and b.is_leaf()
    if a.type is not b.type or a.num_children != b.num_children:
        return False
    if a.type is dict:
        if set(a.context) != set(b.context):
            return False
        kids = dict(zip(a.context, a.children()))
        return all(_same_structure(kids[k], c) for k, c in zip(b.context, b.children()))
    return a.context == b.context and all(
        _same_structure(x, y) for x, y in zip(a.children(), b.children()))
