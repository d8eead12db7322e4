"""The import graph of the package, read from the source (every `import` statement, at the top
of a module or inside a function: a function-local import cannot hide a circle), has no circle
and runs one way between the layers and wings:

    kernels/  <-  models/  <-  passes/, dspark_compile/factory/
    dspark_compile/engine_dir/ (the format)  <-  runtime/  <-  build/  <-  inspection/, cli/, serve/

The runtime never imports the build; the format imports neither; the reference model and the
kernels import no wing of dspark_compile; the kernels never import the passes.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# the package's folders: dspark_compile/ and the three top-level ones it maps (pyproject.toml)
FOLDERS = {"dspark_compile": ROOT / "dspark_compile", "dspark_compile.kernels": ROOT / "kernels",
           "dspark_compile.models": ROOT / "models", "dspark_compile.passes": ROOT / "passes"}
WINGS = ("build", "engine_dir", "runtime", "inspection", "cli", "serve", "factory")
# what each part may not import (a prefix of a module name under dspark_compile.)
FORBIDDEN = {
    "engine_dir": ("build", "runtime", "inspection", "cli", "serve", "factory"),
    "runtime": ("build", "inspection", "cli", "serve", "factory"),
    "build": ("inspection", "cli", "serve"),
    "models": WINGS + ("passes",),
    "kernels": WINGS + ("passes", "models"),
    "passes": WINGS,
    "factory": ("build", "engine_dir", "runtime", "inspection", "cli", "serve"),
    "inspection": ("build", "cli", "serve", "factory"),
    "serve": ("build", "inspection", "factory"),
}


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in FOLDERS.items():
        for f in folder.rglob("*.py"):
            rel = f.relative_to(folder).with_suffix("")
            if prefix == "dspark_compile" and rel.parts[0] in ("kernels", "models", "passes"):
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([prefix, *parts])] = f
    return out


def _resolve(name: str, known: dict) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


@functools.lru_cache(maxsize=None)
def import_graph() -> nx.DiGraph:
    """module -> module for every import of a project module, wherever it stands."""
    known = modules()
    g = nx.DiGraph()
    g.add_nodes_from(known)
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                if t.startswith("dspark_compile"):
                    dst = _resolve(t, known)
                    if dst and dst != name:
                        g.add_edge(name, dst, line=node.lineno)
    return g


def _part(module: str) -> str:
    """The part a module belongs to: a wing, or kernels / models / passes, or '' (the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_is_read_from_every_module():
    g = import_graph()
    # the graph can fail: the known arrows are there (a reader that found nothing would pass)
    assert g.has_edge("dspark_compile.runtime.engine", "dspark_compile.engine_dir.load")
    assert g.has_edge("dspark_compile.build.pipeline", "dspark_compile.engine_dir.write")
    assert len(g) > 140 and g.number_of_edges() > 300


def test_no_import_circle():
    g = import_graph()
    circles = [c for c in nx.simple_cycles(g) if len(c) > 1]
    assert not circles, "import circles: " + "; ".join(" -> ".join(c + [c[0]])
                                                       for c in circles[:5])


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_imports_run_one_way(part):
    g = import_graph()
    bad = []
    for src, dst, data in g.edges(data=True):
        if _part(src) == part and _part(dst) in FORBIDDEN[part]:
            bad.append(f"{_file(src)}:{data['line']} imports {dst}")
    assert not bad, "\n".join(bad)


def _file(module: str) -> str:
    return str(modules()[module].relative_to(ROOT))
