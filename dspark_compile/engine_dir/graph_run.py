"""A loaded program made runnable fast: the engine's runtime callable (Engine, PrefillPrograms).

`GraphProgram.module()` (engine_dir/graph_read.py) rebuilds the torch.fx GraphModule
`ep.module()` would: an fx Graph of every node, then fx's code generation. At Flash-0731's depth
that is most of an engine's program load (a tiny-deep step, 3,104 nodes: 0.09 s to read and
check, 0.56 s to build its module on a 2-core CPU; a default engine has ~25 such programs). A
`ProgramRunner` skips the fx Graph: it writes the straight-line function itself from the checked
node list and compiles it once.

Nothing from the engine's files reaches the generated source: values are local variables named
by position (`v12`), operators are looked up by position in a list of the resolved operator
objects (`_ops[3]`), and every literal (ints included), keyword name and lifted tensor comes
from a list by position (`_k[7]`, `_w[2]`); the source text holds only those names, integers
written by this module and Python syntax. A value is dropped after its last use (`v12 = None`),
as fx's generated code does, so an eager run and a CUDA-graph capture hold the same
intermediates alive as the GraphModule would.

The runner is an nn.Module holding the lifted tensors as flat attributes (the same tensor
objects as the engine's weights) and calls like the module: `runner(rows, state)`, its inputs
checked against the program's shapes. Tools that walk a graph use `runner.graph_module` (built
on first use) or `runner.graph`.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch.fx._pytree import tree_flatten_spec
from torch.utils import _pytree as pytree

from dspark_compile.engine_dir.graph_program import GraphProgram, _assign, _InputCheck, _Ref

_COPY = torch.ops.aten.copy_.default


class _Source:
    """The generated function's text and its pools (operators, literals)."""

    def __init__(self):
        self.lines: list[str] = []
        self.ops: list = []
        self.op_index: dict = {}
        self.k: list = []

    def op(self, fn) -> str:
        if id(fn) not in self.op_index:
            self.op_index[id(fn)] = len(self.ops)
            self.ops.append(fn)
        return f"_ops[{self.op_index[id(fn)]}]"

    def lit(self, v) -> str:
        self.k.append(v)
        return f"_k[{len(self.k) - 1}]"

    def expr(self, v, env: dict) -> str:
        if isinstance(v, _Ref):
            return env[v.name]
        if isinstance(v, list):
            return "[" + ", ".join(self.expr(x, env) for x in v) + "]"
        if isinstance(v, tuple):
            return "(" + "".join(self.expr(x, env) + ", " for x in v) + ")"
        return self.lit(v)

    def call(self, fn, args: tuple, kwargs: dict, env: dict) -> str:
        parts = [self.expr(a, env) for a in args]
        if kwargs:
            parts.append("**{" + ", ".join(f"{self.lit(k)}: {self.expr(v, env)}"
                                           for k, v in kwargs.items()) + "}")
        return f"{self.op(fn)}({', '.join(parts)})"


def _refs(v, out: list) -> list:
    if isinstance(v, _Ref):
        out.append(v.name)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _refs(x, out)
    elif isinstance(v, dict):
        for x in v.values():
            _refs(x, out)
    return out


def _generate(program: GraphProgram):
    """(the compiled function `_run(_a, _w, _ops, _k)`, its operator and literal pools)."""
    src = _Source()
    env: dict = {}
    body: list[str] = []
    users = [i for i in program.inputs if i.kind == "user"]
    lifted = [i for i in program.inputs if i.kind != "user"]
    for j, i in enumerate(users):
        env[i.name] = f"a{j}"
        body.append(f"a{j} = _a[{j}]")
    for j, i in enumerate(lifted):
        env[i.name] = f"w{j}"
        body.append(f"w{j} = _w[{j}]")
    # the last node reading each value: values of nodes die after it (inputs are references)
    last: dict = {}
    for n, (name, _, args, kwargs) in enumerate(program.nodes):
        for r in _refs(args, []) + _refs(kwargs, []):
            last[r] = n
    outputs = {r for _, _, v in program.outputs for r in _refs(v, [])}
    dying: dict = {}
    for name, n in last.items():
        if name not in outputs and name not in env:
            dying.setdefault(n, []).append(name)
    for n, (name, fn, args, kwargs) in enumerate(program.nodes):
        var = f"v{n}"
        body.append(f"{var} = {src.call(fn, args, kwargs, env)}")
        env[name] = var
        body.extend(f"{env[d]} = None" for d in dying.get(n, ()))
    results, copies = [], {}
    for kind, target, value in program.outputs:
        if kind == "user":
            results.append(value)
            continue
        dest = next(i.name for i in program.inputs
                    if (i.name == target if kind == "user_input_mutation" else i.target == target))
        copies[value.name] = src.call(_COPY, (_Ref(dest), value), {}, env)
    for k, (name, expr) in enumerate(copies.items()):
        body.append(f"c{k} = {expr}")
        env[name] = f"c{k}"
    body.append("return (" + "".join(src.expr(v, env) + ", " for v in results) + ")")
    text = "def _run(_a, _w, _ops, _k):\n" + "".join(f"    {line}\n" for line in body)
    scope: dict = {}
    exec(compile(text, f"<dspark program {program.rel}>", "exec"), {"__builtins__": {}}, scope)
    return scope["_run"], src.ops, src.k


class ProgramRunner(torch.nn.Module):
    """A GraphProgram as a callable module (the module comment)."""

    def __init__(self, program: GraphProgram,
                 weights: Optional[Mapping[str, torch.Tensor]] = None,
                 validate_inputs: bool = True):
        super().__init__()
        weights = program._bound() if weights is None else weights
        lifted = []
        for i in program.inputs:
            if i.kind != "user":
                t = program._lifted(i, weights)
                _assign(self, i, t, program.rel, i.name)
                lifted.append(getattr(self, i.name))
        self._program, self._weights = program, weights
        self._lifted_inputs = lifted
        self._run, self._ops, self._k = _generate(program)
        self._in_spec, self._out_spec = program.in_spec, program.out_spec
        self._check = _InputCheck(program)
        self.validate_inputs = validate_inputs
        self._gm = None

    def forward(self, *args):
        self._check(self, args, {})
        flat = tree_flatten_spec((list(args), {}), self._in_spec)
        outs = self._run(flat, self._lifted_inputs, self._ops, self._k)
        return pytree.tree_unflatten(list(outs), self._out_spec)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The program's fx GraphModule over the same tensors (built on first use)."""
        if self._gm is None:
            self._gm = self._program.module(self._weights, self.validate_inputs)
        return self._gm

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph
