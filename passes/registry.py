"""Pass declarations and the one place the pipeline order is built.

    @register_pass(name="remove_asserts", stage="cleanup")
    def remove_asserts_pass(gm, ctx): ...

A declaration says what must hold, not where the pass sits in a list:
- `requires`: passes that must run before this one *and* must be in the pipeline;
- `after`: soft ordering, "if that pass is in the pipeline, run after it";
- `stage`: cleanup < fusion < lint (every pass of an earlier stage runs first);
- `default`: part of the pipeline when the caller names no passes;
- `expect_match`: the manager warns when the pass matched nothing.

`build_pipeline` turns the declarations into a networkx DAG and takes its lexicographic
topological order, tie-broken by the caller's order (or by name for the default pipeline), so
the order is deterministic and independent of import order. An unknown name, a missing
requirement or a cycle raises `PassPipelineError` naming the passes.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import marshal
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import networkx as nx

from dspark_compile.passes.base import STAGES, PassConfig, PassPipelineError


@dataclass
class PassSpec:
    name: str
    fn: Callable
    requires: tuple = ()
    after: tuple = ()
    stage: str = "fusion"
    default: bool = True
    expect_match: bool = False
    description: str = ""
    source_hash: str = field(default="", repr=False)


def source_hash(obj) -> str:
    """sha256 of the source of the module that defines `obj` (a pass function or class).

    Editing anything in a pass's file changes its hash, and so the engine manifest. Objects
    without a source file (e.g. code exec'd from the docs) hash their compiled code instead.
    """
    module = sys.modules.get(getattr(obj, "__module__", ""), None)
    path = None
    try:
        path = inspect.getsourcefile(module) if module is not None else None
    except TypeError:
        path = None
    if path:
        try:
            with open(path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
        except OSError:
            pass
    code = getattr(obj, "__code__", None) or getattr(getattr(obj, "__call__", None), "__code__",
                                                     None)
    if code is None:
        raise PassPipelineError(f"cannot hash the source of {obj!r}")
    return hashlib.sha256(marshal.dumps(code)).hexdigest()


class PassRegistry:
    def __init__(self):
        self._specs: dict[str, PassSpec] = {}

    def __contains__(self, name) -> bool:
        return name in self._specs

    def __getitem__(self, name) -> PassSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise PassPipelineError(
                f"unknown pass '{name}'; registered passes: {sorted(self._specs)}") from None

    def names(self) -> list[str]:
        return sorted(self._specs)

    def add(self, spec: PassSpec, replace: bool = False) -> PassSpec:
        if spec.stage not in STAGES:
            raise PassPipelineError(f"pass '{spec.name}': stage must be one of {STAGES}, "
                                    f"got '{spec.stage}'")
        if spec.name in self._specs and not replace:
            raise PassPipelineError(f"pass '{spec.name}' is registered twice")
        if not spec.source_hash:
            spec.source_hash = source_hash(spec.fn)
        self._specs[spec.name] = spec
        return spec

    def remove(self, name: str) -> None:
        self._specs.pop(name, None)

    def copy(self) -> "PassRegistry":
        new = PassRegistry()
        new._specs = dict(self._specs)
        return new

    def default_names(self) -> list[str]:
        return [n for n, s in sorted(self._specs.items()) if s.default]

    def build_pipeline(self, names: Optional[Iterable[str]] = None,
                       config: Optional[PassConfig] = None) -> list[PassSpec]:
        """Resolve `names` (default: every `default=True` pass, minus `config.disabled`) into
        the run order."""
        config = config or PassConfig()
        explicit = names is not None
        requested = list(dict.fromkeys(names)) if explicit else self.default_names()
        for n in list(requested) + sorted(config.disabled):
            self[n]  # unknown name -> error naming it
        if explicit:
            both = [n for n in requested if n in config.disabled]
            if both:
                raise PassPipelineError(f"passes {both} are both requested and disabled")
        selected = [n for n in requested if n not in config.disabled]
        chosen = set(selected)

        problems = []
        for n in selected:
            for r in self[n].requires:
                if r not in self:
                    problems.append(f"pass '{n}' requires '{r}', which is not registered")
                elif r in config.disabled:
                    problems.append(f"pass '{n}' requires '{r}', which is disabled in PassConfig")
                elif r not in chosen:
                    problems.append(f"pass '{n}' requires '{r}', which is not in the pipeline "
                                    f"(add '{r}' or drop '{n}')")
        if problems:
            raise PassPipelineError("; ".join(problems))

        g = nx.DiGraph()
        g.add_nodes_from(selected)
        for n in selected:
            spec = self[n]
            for dep in tuple(spec.requires) + tuple(spec.after):
                if dep in chosen:
                    g.add_edge(dep, n, kind="requires" if dep in spec.requires else "after")
        rank = {s: i for i, s in enumerate(STAGES)}
        for a in selected:
            for b in selected:
                if rank[self[a].stage] < rank[self[b].stage] and not g.has_edge(a, b):
                    g.add_edge(a, b, kind="stage")
        try:
            cycle = nx.find_cycle(g)
        except nx.NetworkXNoCycle:
            cycle = None
        if cycle:
            path = " -> ".join([e[0] for e in cycle] + [cycle[0][0]])
            kinds = ", ".join(f"{u}->{v} ({g.edges[u, v]['kind']})" for u, v in cycle)
            raise PassPipelineError(f"pass dependency cycle: {path} [{kinds}]")
        position = {n: i for i, n in enumerate(selected)}
        key = (lambda n: (position[n], n)) if explicit else (lambda n: (0, n))
        order = list(nx.lexicographical_topological_sort(g, key=key))
        return [self[n] for n in order]


REGISTRY = PassRegistry()


def register_pass(name: str, *, requires: Iterable[str] = (), after: Iterable[str] = (),
                  stage: str = "fusion", default: bool = True, expect_match: bool = False,
                  registry: Optional[PassRegistry] = None, replace: bool = False):
    """Decorator: declare `fn(gm, ctx)` (or a class with `__call__(self, gm, ctx)`, which is
    instantiated without arguments) as the pass `name`."""

    def deco(obj):
        fn = obj() if inspect.isclass(obj) else obj
        doc = inspect.getdoc(obj) or ""
        spec = PassSpec(name=name, fn=fn, requires=tuple(requires), after=tuple(after),
                        stage=stage, default=default, expect_match=expect_match,
                        description=doc.split("\n", 1)[0])
        spec.source_hash = source_hash(obj)
        (registry or REGISTRY).add(spec, replace=replace)
        return obj

    return deco


@contextlib.contextmanager
def isolated_registry():
    """Temporarily give `REGISTRY` a copy of its entries; registrations inside are dropped on
    exit (tests, docs examples)."""
    saved = REGISTRY._specs
    REGISTRY._specs = dict(saved)
    try:
        yield REGISTRY
    finally:
        REGISTRY._specs = saved
