"""An engine directory from somewhere else can neither reach outside itself nor run code when it
is loaded (dspark_compile/engine_dir/paths.py, graph_read.py, kernel_store.py; README "What an
engine directory holds").

Every case tampers with a copy of the small CPU engine (tests/runtime/conftest.py) the way its
author could: the file table and the manifest checksum are recomputed with the project's own
helpers, so only the new checks stand in the way. A code payload only writes a marker file in
the test's temporary directory; the marker must never appear. Where the tampered file is a live
exploit of plain torch, a control shows the payload does run there, so the test can fail.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from dspark_compile.engine_dir.format import ArtifactError, _checksum, sha256_file
from dspark_compile.engine_dir.load import load_manifest
from dspark_compile.engine_dir.write import not_an_engine


class Payload:
    """Unpickling this writes `marker` (and nothing else)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def pickled(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    return buf.getvalue()


# ------------------------------------------------------------------ tampering helpers
def copy_engine(small_engine, tmp_path) -> Path:
    eng = tmp_path / "engine"
    shutil.copytree(small_engine.path, eng)
    return eng


def read_manifest(eng: Path) -> dict:
    return json.loads((eng / "manifest.json").read_text())


def write_manifest(eng: Path, m: dict) -> None:
    m["checksum"] = _checksum(m)
    (eng / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True))


def refresh(eng: Path, rel: str, path: Path | None = None) -> dict:
    """The file table entry of `rel` recomputed from `path` (default: the engine's file)."""
    m = read_manifest(eng)
    digest, size = sha256_file(path or eng / rel)
    m["files"][rel] = {"sha256": digest, "size": size}
    write_manifest(eng, m)
    return m


def rewrite_program(eng: Path, rel: str, edit) -> None:
    """Rewrite the engine's graph file `rel` (engine_dir/graph_format.py): `edit` changes its
    JSON document in place; the file table follows."""
    path = eng / rel
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.write_text(json.dumps(doc))
    refresh(eng, rel)


def _first_node(field, value):
    return lambda marker: (lambda doc: doc["nodes"][0].update({field: value}))


def _payload_literal(marker):
    """A literal the reader would have to evaluate: code as a string where a value goes."""
    code = f"exec(\"open({str(marker)!r}, 'w')\")"
    return lambda doc: doc["nodes"][0]["args"].append({"expr": code})


# (case, edit factory(marker), what the refusal says)
GRAPH_CASES = [
    ("os_system_op", _first_node("op", "os.system"), "'os.system'"),
    ("builtins_exec_op", _first_node("op", "builtins.exec"), "'builtins.exec'"),
    ("dunder_op", _first_node("op", "aten.__class__.__init__"), "aten.__class__.__init__"),
    ("python_literal", _payload_literal, "expr"),
    ("code_as_a_name", _first_node("name", "x = __import__('os')"), "not an identifier"),
    ("code_field", lambda mk: (lambda doc: doc.update(code="import os")), "unknown field"),
]


@pytest.mark.parametrize("case, make_edit, says", GRAPH_CASES, ids=[c[0] for c in GRAPH_CASES])
def test_a_program_holding_anything_but_data_is_refused(small_engine, tmp_path, case,
                                                        make_edit, says):
    from dspark_compile.runtime.engine import Engine
    marker = tmp_path / "marker"
    eng = copy_engine(small_engine, tmp_path)
    rewrite_program(eng, "programs/step.json", make_edit(marker))
    load_manifest(eng)                   # checksum and file table agree: the author's view
    with pytest.raises(ArtifactError, match="program 'programs/step.json' is refused") as e:
        Engine.load(eng, device="cpu", target=False)
    assert says in str(e.value)
    assert e.value.path == "programs/step.json"
    assert not marker.exists()


def test_a_pickle_as_a_programs_constants_is_refused(small_engine, tmp_path):
    """A constants file is safetensors, read as bytes: a pickle there is named, never
    unpickled (the control: torch.load of the same bytes runs the payload)."""
    from dspark_compile.runtime.engine import Engine
    marker = tmp_path / "marker"
    eng = copy_engine(small_engine, tmp_path)
    m = read_manifest(eng)
    rel = "programs/step.constants.safetensors"
    (eng / rel).write_bytes(pickled(marker))
    m["programs"]["1"]["constants"] = rel
    write_manifest(eng, m)
    refresh(eng, rel)
    with pytest.raises(ArtifactError, match="programs/step.json") as e:
        Engine.load(eng, device="cpu", target=False)
    assert "constants" in str(e.value)
    assert not marker.exists()
    with contextlib.suppress(Exception):
        torch.load(io.BytesIO(pickled(marker)), weights_only=False)
    assert marker.exists()


def _old_format_engine(small_engine, tmp_path, marker) -> Path:
    """The issue's tampered engine of the old format: format_version 1, its bucket-1 program a
    .pt2 archive whose constant is a pickle of the payload (torch.export.load would run it)."""
    eng = copy_engine(small_engine, tmp_path)
    m = read_manifest(eng)
    rel = "programs/step_b1.pt2"
    with zipfile.ZipFile(eng / rel, "w") as z:
        z.writestr("step_b1/data/constants/tensor_0", pickled(marker))
    m["format_version"] = 1
    m["programs"]["1"]["path"] = rel
    write_manifest(eng, m)
    refresh(eng, rel)
    return eng


def test_run_refuses_an_old_format_engine_in_one_line_and_runs_nothing(small_engine, tmp_path,
                                                                       capsys):
    from dspark_compile.cli.main import main
    marker = tmp_path / "marker"
    eng = _old_format_engine(small_engine, tmp_path, marker)
    rc = main(["run", str(eng), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert "has format_version 1" in err[0] and "rebuild it: dspark-compile build" in err[0]
    assert not marker.exists()


def test_serve_refuses_a_tampered_program_and_runs_nothing(small_engine, tmp_path, capsys,
                                                          monkeypatch):
    pytest.importorskip("fastapi")
    from dspark_compile.cli.main import main
    from dspark_compile.serve import server
    served = []
    monkeypatch.setattr(server.Server, "run", lambda self, *a, **k: served.append(self))
    marker = tmp_path / "marker"
    eng = copy_engine(small_engine, tmp_path)
    rewrite_program(eng, "programs/step.json", _first_node("op", "builtins.exec")(marker))
    rc = main(["serve", str(eng), "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 1 and not served, err
    assert "program 'programs/step.json' is refused" in err
    assert not marker.exists()


def test_every_program_of_a_built_engine_reads_back(small_engine):
    """The reader refuses nothing the build writes (the steps, their greedy variants and the
    target-only programs)."""
    from dspark_compile.engine_dir.format import register_kernel_ops
    from dspark_compile.engine_dir.graph_read import read_program
    register_kernel_ops()
    m = small_engine.manifest
    paths = [p for t in ("programs", "target_programs") for e in m.get(t, {}).values()
             for p in (e["path"], *e.get("variants", {}).values())]
    assert len(paths) == 6
    for rel in paths:
        read_program((Path(small_engine.path) / rel).read_bytes(), None, rel)


# ------------------------------------------------------------------ the kernel store
STORE = "kernels/triton/sm90-triton3.7.1"
KEY = "W2ZGDJ3N4MUWXMHXZGGIHRFR5J5KBCSUUKAYGTBC3FCHQAQWWNCA"
LAUNCHER = "cuda_utils.cpython-312-x86_64-linux-gnu.so"


def _with_store(eng: Path, files: dict, listed=True) -> None:
    m = read_manifest(eng)
    for name, data in files.items():
        p = eng / STORE / KEY / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        if listed:
            digest, size = sha256_file(p)
            m["files"][f"{STORE}/{KEY}/{name}"] = {"sha256": digest, "size": size}
    m["kernel_store"] = {"path": STORE, "sm": "90", "triton": "3.7.1", "cuda": "13.0",
                         "entries": 1, "kernels": 1, "bytes": 1}
    write_manifest(eng, m)


@pytest.mark.parametrize("listed", [True, False], ids=["in_the_file_table", "on_disk_only"])
def test_a_launcher_module_in_the_kernel_store_is_refused_naming_it(small_engine, tmp_path,
                                                                    listed):
    from dspark_compile.runtime.engine import Engine
    eng = copy_engine(small_engine, tmp_path)
    _with_store(eng, {"k.cubin": b"\0" * 64, "k.json": b"{}"})
    load_manifest(eng)                                 # cubins and metadata: a valid store
    _with_store(eng, {LAUNCHER: b"\x7fELF"}, listed=listed)
    for load in (lambda: load_manifest(eng, check_files=False),
                 lambda: Engine.load(eng, device="cpu")):
        with pytest.raises(ArtifactError, match=f"{LAUNCHER}.*only .cubin and .json") as e:
            load()
        assert e.value.path.endswith(LAUNCHER)


def test_a_kernel_store_outside_the_engine_is_refused(small_engine, tmp_path):
    eng = copy_engine(small_engine, tmp_path)
    m = read_manifest(eng)
    m["kernel_store"] = {"path": "../elsewhere", "sm": "90", "triton": "3.7.1"}
    write_manifest(eng, m)
    with pytest.raises(ArtifactError, match="'kernel_store.path'.*'..' component") as e:
        load_manifest(eng)
    assert e.value.field == "kernel_store.path"


# ------------------------------------------------------------------ an Inductor engine is code
def _inductor(small_engine, tmp_path) -> Path:
    eng = copy_engine(small_engine, tmp_path)
    m = read_manifest(eng)
    m["build_config"]["backend"] = "inductor"
    write_manifest(eng, m)
    return eng


def test_an_inductor_engine_loads_only_when_its_code_is_trusted(small_engine, tmp_path):
    from dspark_compile.runtime.engine import Engine
    eng = _inductor(small_engine, tmp_path)
    with pytest.raises(ArtifactError, match="runs the Python code in its compiled/.*"
                                            "--trust-engine-code") as e:
        Engine.load(eng, device="cpu")
    assert e.value.field == "build_config.backend"
    # trusted, the load goes on (and here finds no compiled programs: this is an aten engine
    # relabelled)
    with pytest.raises(ArtifactError, match="'compiled.programs' is missing"):
        Engine.load(eng, device="cpu", trust_code=True)


def test_run_names_the_trust_flag_and_inspect_needs_none(small_engine, tmp_path, capsys):
    from dspark_compile.cli.main import main
    eng = _inductor(small_engine, tmp_path)
    assert main(["run", str(eng), "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass --trust-engine-code" in err[0], err
    assert main(["inspect", str(eng)]) == 0            # reads the manifest, executes nothing
    assert '"backend": "inductor"' in capsys.readouterr().out


# ------------------------------------------------------------------ paths leaving the engine
SECRET = b"the secret of a file outside the engine\n"


def _outside(tmp_path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.txt").write_bytes(SECRET)
    return out


def _dotdot(eng, outside):
    """The issue's oracle: a file table entry for ../outside/secret.txt with its true size."""
    m = read_manifest(eng)
    m["files"]["../outside/secret.txt"] = {"sha256": "0" * 64, "size": len(SECRET)}
    write_manifest(eng, m)
    return "files.../outside/secret.txt"


def _absolute(eng, outside):
    """The weights loaded from an absolute path outside the engine (checksummed)."""
    shutil.copy(eng / "weights.safetensors", outside / "weights.safetensors")
    rel = str(outside / "weights.safetensors")
    m = read_manifest(eng)
    m["weights"]["file"] = rel
    m["files"][rel] = m["files"].pop("weights.safetensors")
    (eng / "weights.safetensors").unlink()
    write_manifest(eng, m)
    return f"files.{rel}"


def _dotdot_program(eng, outside):
    """Bucket 2's program (the one step program) from ../outside/step.json (the issue's case)."""
    shutil.move(eng / "programs/step.json", outside / "step.json")
    m = read_manifest(eng)
    m["files"]["../outside/step.json"] = m["files"].pop("programs/step.json")
    m["programs"]["2"]["path"] = "../outside/step.json"
    write_manifest(eng, m)
    return "files.../outside/step.json"


def _file_link(eng, outside):
    shutil.move(eng / "programs/step.json", outside / "step.json")
    (eng / "programs/step.json").symlink_to(outside / "step.json")
    return "programs/step.json"


def _dir_link(eng, outside):
    shutil.move(eng / "programs", outside / "programs")
    (eng / "programs").symlink_to(outside / "programs")
    return "programs"


LEAVES = {"dotdot_file_table": (_dotdot, "'..' component"),
          "absolute_weights": (_absolute, "is absolute"),
          "dotdot_program": (_dotdot_program, "'..' component"),
          "symlinked_file": (_file_link, "is a symbolic link"),
          "symlinked_subdirectory": (_dir_link, "is a symbolic link")}


@contextlib.contextmanager
def opened_paths():
    """Every path Python opens or lists inside the block (audit events), to show that nothing
    outside the engine is read, not even for a size or a checksum."""
    seen: list = []
    active = [True]

    def hook(event, args):
        if active[0] and event in ("open", "os.listdir", "os.scandir") and args \
                and isinstance(args[0], (str, bytes, Path)):
            seen.append(str(args[0]))
    sys.addaudithook(hook)
    try:
        yield seen
    finally:
        active[0] = False


@pytest.mark.parametrize("case", sorted(LEAVES))
def test_a_path_leaving_the_engine_is_refused_before_anything_is_read(small_engine, tmp_path,
                                                                      capsys, case):
    from dspark_compile.cli.main import main
    from dspark_compile.runtime.engine import Engine
    make, says = LEAVES[case]
    outside = _outside(tmp_path)
    eng = copy_engine(small_engine, tmp_path)
    named = make(eng, outside)
    before = sorted(p.name for p in outside.rglob("*"))
    with opened_paths() as seen:
        for load in (lambda: load_manifest(eng), lambda: load_manifest(eng, check_files=False),
                     lambda: Engine.load(eng, device="cpu")):
            with pytest.raises(ArtifactError, match=says) as e:
                load()
            assert named in str(e.value), e.value
        # inspect: one line naming it, and neither the size nor the checksum of anything
        # outside (the oracle)
        assert main(["inspect", str(eng)]) == 1
    cap = capsys.readouterr()
    assert named in cap.err and says in cap.err and SECRET.hex()[:12] not in cap.err
    assert not [p for p in seen if os.path.realpath(p).startswith(str(outside.resolve()))], seen
    # build --overwrite's check: refused, and nothing outside is touched
    why = not_an_engine(eng)
    assert why is not None and ("outside it" in why or "symbolic link" in why), why
    assert sorted(p.name for p in outside.rglob("*")) == before


def test_build_overwrite_refuses_such_a_directory(small_engine, tiny_ckpt, tmp_path, capsys):
    from dspark_compile.cli.main import main
    outside = _outside(tmp_path)
    eng = copy_engine(small_engine, tmp_path)
    _dotdot(eng, outside)
    rc = main(["build", str(tiny_ckpt), "--out", str(eng), "--overwrite", "--device", "cpu",
               "--buckets", "1", "--prefill-chunks", "none"])
    err = capsys.readouterr().err
    assert rc == 1 and "names a file outside it" in err, err
    assert (outside / "secret.txt").read_bytes() == SECRET
    link = tmp_path / "link"
    link.symlink_to(eng)
    assert "is a symbolic link" in not_an_engine(link)


def test_a_symlinked_engine_directory_itself_loads(small_engine, tmp_path):
    """The directory the user names may be a link (engines/latest): what is below it is
    checked."""
    link = tmp_path / "latest"
    link.symlink_to(small_engine.path)
    assert load_manifest(link, check_files=False)["buckets"] == [1, 2]


# ------------------------------------------------------------------ other hostile directories
@pytest.mark.parametrize("where", ["manifest.json", "programs/step.json", "notes.fifo"])
def test_a_fifo_in_the_engine_is_refused_without_blocking(small_engine, tmp_path, where):
    """Opening a FIFO for reading blocks until a writer comes: the load must not try."""
    from dspark_compile.runtime.engine import Engine
    eng = copy_engine(small_engine, tmp_path)
    if (eng / where).exists():
        (eng / where).unlink()
    os.mkfifo(eng / where)
    with pytest.raises(ArtifactError, match="not a (regular )?file"):
        Engine.load(eng, device="cpu")


def test_a_tokenizer_outside_the_file_table_is_refused(small_engine, tmp_path):
    """serve reads tokenizer.json: one the manifest does not checksum is not the engine's."""
    eng = copy_engine(small_engine, tmp_path)
    m = read_manifest(eng)
    del m["files"]["tokenizer.json"]
    write_manifest(eng, m)
    with pytest.raises(ArtifactError, match="'tokenizer.json' is not in the manifest's file table"):
        load_manifest(eng, check_files=False)


@pytest.mark.parametrize("path, says", [
    ("programs/step.json\x00.txt", "holds a NUL character"),
    ("programs\\step_b1.json", "holds a backslash"),
    ("programs//step_b1.json", "empty, '.' or '..' component"),
    ("programs/x\udcff.json", "is not valid UTF-8"),
])
def test_a_program_path_that_is_not_a_plain_relative_path_is_refused(small_engine, tmp_path,
                                                                     path, says):
    eng = copy_engine(small_engine, tmp_path)
    m = read_manifest(eng)
    m["programs"]["1"]["path"] = path
    write_manifest(eng, m)
    with pytest.raises(ArtifactError, match=says) as e:
        load_manifest(eng, check_files=False)
    assert e.value.field == "programs.1.path"


def test_a_manifest_with_a_duplicated_key_is_refused(small_engine, tmp_path):
    eng = copy_engine(small_engine, tmp_path)
    m = read_manifest(eng)
    m["checksum"] = _checksum(m)
    text = json.dumps(m, indent=1, sort_keys=True)
    (eng / "manifest.json").write_text(text[:-2] + ',\n "buckets": [1]\n}')
    with pytest.raises(ArtifactError, match="the key 'buckets' is given twice"):
        load_manifest(eng, check_files=False)
