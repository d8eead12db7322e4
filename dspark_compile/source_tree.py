"""Python started in the repository root: the source tree's top-level folders as packages.

The distribution installs four top-level folders of the repository as one package
(pyproject.toml's package-dir): dspark_compile/ and, inside it, kernels/, models/ and passes/
as dspark_compile.kernels, .models and .passes. An installed copy holds them in the package's
folder, and an editable install maps them with its own import finder. Python started in the
repository root has the root first on sys.path, which brings two problems:

1. `import dspark_compile` finds the source tree's dspark_compile/ (shadowing either install),
   whose folder does not hold the three subpackages. `SourceTreeFinder`, installed by
   dspark_compile/__init__.py, resolves exactly those three names to the folders beside it.
2. `import kernels` (or models, passes) finds the folder under its bare name, before any
   installed package of that name: transformers imports the `kernels` distribution (Hugging
   Face's hub kernels) and got this repository's kernels/ instead (`ImportError: cannot
   import name 'CUDAProperties' from 'kernels'`). Each folder's __init__.py therefore starts
   with `if __name__ != "dspark_compile.<name>": hand_over(__name__)`, which imports the
   package of that name installed outside the root in the folder's place, or fails as the
   import would without the folder.

tests/test_packaging.py imports every module in each of the four ways (editable install from
the root and elsewhere, normal install from the root and elsewhere) and checks both problems.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("kernels", "models", "passes")


def is_source_tree() -> bool:
    """Whether this package was imported from the repository (not from an install)."""
    return ((SOURCE_ROOT / "pyproject.toml").is_file()
            and all((SOURCE_ROOT / n / "__init__.py").is_file() for n in SUBPACKAGES))


class SourceTreeFinder:
    """Finds dspark_compile.{kernels,models,passes} in the source tree's top-level folders."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        if parent != "dspark_compile" or name not in SUBPACKAGES:
            return None
        folder = SOURCE_ROOT / name
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def install_finder() -> None:
    """Append SourceTreeFinder to sys.meta_path once, by name (a second copy of this package,
    the source tree's beside an install's, adds none), after every other finder."""
    if is_source_tree() and not any(getattr(f, "__name__", None) == SourceTreeFinder.__name__
                                    for f in sys.meta_path):
        sys.meta_path.append(SourceTreeFinder)


def _is_root(entry) -> bool:
    try:
        return Path(os.fspath(entry) or ".").resolve() == SOURCE_ROOT
    except (TypeError, OSError):
        return False


def _in_folder(spec, folder: Path) -> bool:
    origin = spec.origin or next(iter(spec.submodule_search_locations or ()), None)
    return origin is not None and Path(origin).resolve().is_relative_to(folder)


def installed_spec(name: str):
    """The spec of the top-level package `name` as Python would find it without the repository
    root on sys.path (None: none is installed)."""
    folder = (SOURCE_ROOT / name).resolve()
    path = [p for p in sys.path if not _is_root(p)]
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec(name, path)
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, None)
        else:
            continue
        if spec is not None and not _in_folder(spec, folder):
            return spec
    return None


def hand_over(name: str) -> None:
    """Called by kernels/, models/ or passes/ imported under its bare `name` (Python started in
    the repository root): the package `name` installed outside the root is imported and put in
    sys.modules[name], which the import system returns once the folder's __init__ has run. None
    installed: ModuleNotFoundError for `name`, as without the folder."""
    spec = installed_spec(name)
    if spec is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (the repository's {name}/ folder is the package "
            f"dspark_compile.{name}: import it by that name)", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # as the import system does, before its body runs
    spec.loader.exec_module(module)
