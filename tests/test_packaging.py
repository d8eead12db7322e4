"""The package imports the same however it is installed and wherever Python starts.

pyproject.toml installs four top-level folders as one package (dspark_compile/, and kernels/,
models/, passes/ as dspark_compile.kernels, .models, .passes). A mapping like that breaks
quietly: a subpackage missing from pyproject's package list is absent from a normal install
only; Python started in the repository root imports the source tree's dspark_compile/ first,
whose subpackages are not inside it. Each case below imports every module of the four packages
in a fresh interpreter and checks which files they came from.
"""
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"dspark_compile": "dspark_compile", "dspark_compile.kernels": "kernels",
           "dspark_compile.models": "models", "dspark_compile.passes": "passes"}

PROBE = r"""
import importlib, json, pkgutil, sys
found = {}
for pkg in %r:
    mod = importlib.import_module(pkg)
    found[pkg] = mod.__file__
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        if info.name.split(".")[1] in ("kernels", "models", "passes") and pkg == "dspark_compile":
            continue            # listed under their own package
        if info.name.endswith(".__main__"):
            continue            # `python -m` runs it: importing it runs the program
        found[info.name] = importlib.import_module(info.name).__file__
print(json.dumps(found))
""" % (list(FOLDERS),)


def source_modules() -> set[str]:
    """Every module the source tree holds, as the installed package names it."""
    names = set()
    for pkg, folder in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if "__pycache__" in rel.parts or rel.name == "__main__":
                continue
            names.add(".".join([pkg, *parts]))
    return names


def import_everything(cwd: Path, pythonpath: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"import from {cwd} failed:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_from(found: dict[str, str], root: Path, installed: bool) -> None:
    """Every source module was imported, each from `root`: an installed copy (everything inside
    root/dspark_compile) or the repository (each package from its own folder)."""
    missing = source_modules() - set(found)
    assert not missing, f"modules not importable: {sorted(missing)}"
    for name, file in found.items():
        pkg = ".".join(name.split(".")[:2])
        folder = "dspark_compile" if installed else FOLDERS.get(pkg, "dspark_compile")
        assert Path(file).resolve().is_relative_to((root / folder).resolve()), \
            f"{name} came from {file}, expected under {root / folder}"


def editable_install() -> bool:
    """Whether this interpreter's site-packages hold an editable install of the project (read
    there: from the repository root, importlib.metadata finds the build's egg-info first)."""
    sites = [p for p in sys.path if p.endswith("site-packages")]
    for dist in importlib.metadata.distributions(path=sites):
        if dist.metadata["Name"] == "dspark-compile":
            direct = dist.read_text("direct_url.json")
            return bool(direct) and json.loads(direct).get("dir_info", {}).get("editable", False)
    return False


@pytest.mark.parametrize("where", ["repository root", "another directory"])
def test_editable_install_imports_every_module(where, tmp_path):
    if not editable_install():
        pytest.skip("dspark-compile is not installed editable here (`pip install -e .`)")
    cwd = REPO if where == "repository root" else tmp_path
    assert_from(import_everything(cwd), REPO, installed=False)


@pytest.fixture(scope="module")
def normal_install(tmp_path_factory):
    """A non-editable install of a copy of the source tree into its own folder."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for item in ("pyproject.toml", *FOLDERS.values()):
        copy = shutil.copytree if (REPO / item).is_dir() else shutil.copy2
        copy(REPO / item, src / item, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                         if (REPO / item).is_dir() else {}))
    target = tmp / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "--target", str(target), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip install failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return target


def test_normal_install_from_another_directory(normal_install, tmp_path):
    found = import_everything(tmp_path, pythonpath=str(normal_install))
    assert_from(found, normal_install, installed=True)


def test_normal_install_from_the_repository_root(normal_install):
    # the source tree's dspark_compile/ shadows the installed copy; its subpackages must resolve
    # to the source tree's folders, not fail and not mix with the installed copy
    found = import_everything(REPO, pythonpath=str(normal_install))
    assert_from(found, REPO, installed=False)


# ---- the folders under their bare names (dspark_compile/source_tree.py) ------------------------

BARE = ("kernels", "models", "passes")


def run_in_root(code: str, *flags: str, pythonpath: str | None = None):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_bare_name_from_the_root_is_the_package_installed_under_it(tmp_path):
    """`import kernels` in the root gives the installed `kernels` (here a stand-in on PYTHONPATH,
    which also comes before .venv's real one), not the repository's folder; its submodules come
    from it too, and dspark_compile.kernels is still the folder."""
    for name in BARE:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"WHO = 'installed {name}'\n")
        (tmp_path / name / "sub.py").write_text("X = 1\n")
    code = ("import importlib, json, sys\n"
            "found = {}\n"
            f"for name in {BARE!r}:\n"
            "    bare = importlib.import_module(name)\n"
            "    sub = importlib.import_module(name + '.sub')\n"
            "    ours = importlib.import_module('dspark_compile.' + name)\n"
            "    found[name] = [bare.WHO, bare.__file__, sub.__file__, ours.__file__,\n"
            "                   sys.modules[name] is bare]\n"
            "print(json.dumps(found))\n")
    r = run_in_root(code, pythonpath=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    for name in BARE:
        who, bare, sub, ours, same = found[name]
        assert who == f"installed {name}" and same, found[name]
        assert Path(bare).parent == tmp_path / name and Path(sub).parent == tmp_path / name
        assert Path(ours).resolve() == (REPO / name / "__init__.py").resolve()


def test_a_bare_name_from_the_root_with_none_installed_is_not_found():
    """With no package of that name installed (-S: no site-packages, so not .venv's `kernels`
    either), `import kernels` in the root is ModuleNotFoundError naming `kernels`, and the
    message says the folder is dspark_compile.kernels."""
    code = ("import json\n"
            "errors = {}\n"
            f"for name in {BARE!r}:\n"
            "    try:\n"
            "        __import__(name)\n"
            "    except ModuleNotFoundError as e:\n"
            "        errors[name] = [e.name, str(e)]\n"
            "print(json.dumps(errors))\n")
    r = run_in_root(code, "-S")
    assert r.returncode == 0, r.stderr[-3000:]
    errors = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(errors) == sorted(BARE), f"imported from the repository: {r.stdout}"
    for name, (missing, message) in errors.items():
        assert missing == name and f"dspark_compile.{name}" in message, message


def test_transformers_deepseek_v4_imports_from_the_root():
    """transformers imports the `kernels` distribution (Hugging Face's hub kernels): from the
    root it must get that, not the repository's kernels/ (ImportError: cannot import name
    'CUDAProperties' from 'kernels')."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (the `test` extra installs it)")
    r = run_in_root("from transformers import DeepseekV4ForCausalLM")
    assert r.returncode == 0, r.stderr[-3000:]
