"""dspark-compile: an ahead-of-time graph compiler for DeepSeek-V4 DSpark speculative decoding.

The distribution installs four top-level folders of the repository as one package
(pyproject.toml's package-dir): dspark_compile/ and, inside it, kernels/, models/ and passes/
as dspark_compile.kernels, .models and .passes. An installed copy holds them in this package's
folder, and an editable install maps them with its own import finder. Python started in the
repository root imports this folder from the source tree instead, shadowing either install;
then the three subpackages lie beside it, and the finder below resolves exactly those three
names there (tests/test_packaging.py imports every module in each of these four ways).
"""
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

_SOURCE_ROOT = _Path(__file__).resolve().parent.parent
_SUBPACKAGES = ("kernels", "models", "passes")


class _SourceTreeFinder:
    """Finds dspark_compile.{kernels,models,passes} in the source tree's top-level folders."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in _SUBPACKAGES:
            return None
        folder = _SOURCE_ROOT / name
        return _util.spec_from_file_location(fullname, folder / "__init__.py",
                                             submodule_search_locations=[str(folder)])


if ((_SOURCE_ROOT / "pyproject.toml").is_file()
        and all((_SOURCE_ROOT / n / "__init__.py").is_file() for n in _SUBPACKAGES)
        and not any(isinstance(f, type) and f.__name__ == "_SourceTreeFinder"
                    for f in _sys.meta_path)):
    _sys.meta_path.append(_SourceTreeFinder)
