"""The build's and synth's output: one writer a destination (a second is refused at once, naming
the first; a killed writer's lock never blocks the next), an output that appears during a write
is never replaced without overwrite, and a disk too small is one line naming the output and the
bytes it needs, found before the write where the size is known, with no temporary left behind.

The free space of a file system is passed in (save_engine / build_engine / synth_checkpoint's
`free_bytes`, or dspark_compile/atomic_dir.py's `free_bytes` under the CLI) and write failures are
raised by the writers here: a real full disk needs a mount, which needs root. One test writes
for real past a file-size limit (RLIMIT_FSIZE, EFBIG), which any user can set."""
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from dspark_compile.cli import main as cli
from dspark_compile.engine_dir import write as artifact
from dspark_compile.engine_dir.format import ArtifactError
from dspark_compile.engine_dir.load import load_manifest
from dspark_compile.engine_dir.write import save_engine
from dspark_compile import atomic_dir
from dspark_compile.factory import synth
from dspark_compile.atomic_dir import (NoSpaceError, OutputLocked, lock_path,
                                              move_into_place, output_lock)
from dspark_compile.factory.presets import preset

FIELDS = {"model_config_hash": "toy", "passes": []}
BUILD = ["--device", "cpu", "--buckets", "1", "--max-seq-len", "64", "--prefill-chunks", "none",
         "--no-target-programs"]


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x)


@pytest.fixture(scope="module")
def toy():
    return torch.export.export(Toy(), (torch.zeros(2, 64),))


@pytest.fixture
def config_only(tmp_path):
    """A checkpoint directory with the tiny config.json and no weights: a build that gets past
    the lock fails at loading, with a different message."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(preset("tiny")))
    return d


def _error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"dspark-compile {command}: error: "), err
    return lines[0]


def _hidden(parent) -> list[str]:
    """Temporaries, parked directories and lock files a writer left in `parent`."""
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


# A second process that takes the lock through the same module (loaded from its file: the
# package would import torch, seconds) and holds it until its stdin closes or it is killed.
HOLDER = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("atomic_dir", sys.argv[1])
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    with m.output_lock(sys.argv[2], sys.argv[3]):
        print("held", flush=True)
        sys.stdin.readline()
""")


def _hold(dest, what="build") -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, atomic_dir.__file__, str(dest), what],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def _release(p: subprocess.Popen) -> None:
    p.stdin.close()
    assert p.wait(timeout=30) == 0


def _says_holder(line: str, pid: int, what: str) -> None:
    assert re.search(rf"is being written by another process \(pid {pid} on host "
                     rf"{re.escape(socket.gethostname())}, a {what} started "
                     rf"\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d", line), line


# ------------------------------------------------------------------ one writer a destination
def test_a_second_build_of_one_output_is_refused_naming_the_first(config_only, tmp_path, capsys):
    out = tmp_path / "engine"
    holder = _hold(out)
    try:
        # refused before loading: this checkpoint has no weights, a load would say so instead
        assert cli.main(["build", str(config_only), "--out", str(out), *BUILD]) == 1
        _says_holder(_error_line(capsys.readouterr().err, "build"), holder.pid, "build")
        assert cli.main(["synth", "--preset", "tiny", "--out", str(out)]) == 1
        _says_holder(_error_line(capsys.readouterr().err, "synth"), holder.pid, "build")
    finally:
        _release(holder)
    assert not out.exists() and _hidden(tmp_path) == []


def test_the_cli_in_another_process_is_refused_naming_this_one(config_only, tmp_path):
    """The issue's case as two real CLI-level processes: this test holds the lock through the
    API the build uses, `dspark-compile build` runs beside it."""
    out = tmp_path / "engine"
    with output_lock(out, "build"):
        r = subprocess.run([sys.executable, "-m", "dspark_compile.cli.main", "build",
                            str(config_only), "--out", str(out), *BUILD],
                           capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    _says_holder(_error_line(r.stderr, "build"), os.getpid(), "build")
    assert not out.exists() and _hidden(tmp_path) == []


def test_a_killed_writers_lock_never_blocks_the_next(config_only, toy, tmp_path, capsys):
    ck, eng = tmp_path / "ck", tmp_path / "engine"
    for dest in (ck, eng):
        holder = _hold(dest)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert lock_path(dest).is_file()     # the file stays; the kernel dropped its lock
    assert cli.main(["synth", "--preset", "tiny", "--out", str(ck)]) == 0
    # the build gets past the lock: it fails loading this weightless checkpoint instead
    assert cli.main(["build", str(config_only), "--out", str(eng), *BUILD]) == 1
    assert "safetensors" in _error_line(capsys.readouterr().err, "build")
    save_engine(eng, {1: toy}, manifest_fields=FIELDS, overwrite=False)
    load_manifest(eng)
    assert _hidden(tmp_path) == []           # each writer removed the lock file it held


def test_the_lock_is_reentrant_in_one_thread_only(tmp_path):
    import threading
    out = tmp_path / "engine"
    with output_lock(out, "build"), output_lock(tmp_path / "." / "engine", "build"):
        seen = []
        t = threading.Thread(target=lambda: seen.append(_try_lock(out)))
        t.start()
        t.join()
        assert "another thread of this process" in seen[0]
    assert _hidden(tmp_path) == []


def _try_lock(out):
    try:
        with output_lock(out):
            return "locked"
    except OutputLocked as e:
        return str(e)


def test_a_link_planted_at_the_lock_s_name_is_never_written_through(toy, tmp_path):
    """In a shared directory another user could link `.NAME.lock` to a file of this one's:
    taking the lock must not truncate and overwrite that file."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "engine"
    lock_path(out).symlink_to(victim)
    with pytest.raises(OutputLocked, match="is a symbolic link"):
        save_engine(out, {1: toy}, manifest_fields=FIELDS)
    assert victim.read_text() == "precious" and not out.exists()


def test_an_engine_that_appears_during_the_write_is_never_replaced(toy, tmp_path, monkeypatch):
    """Another writer that takes no lock finishes first: without overwrite its engine stays
    and this write fails naming the output; with overwrite (the library default) it is
    replaced, as an engine may be."""
    out = tmp_path / "engine"
    real = artifact._save_weights

    def theirs_appears(store, path):
        out.mkdir()
        (out / "manifest.json").write_text('{"files": {}, "by": "them"}')
        return real(store, path)

    monkeypatch.setattr(artifact, "_save_weights", theirs_appears)
    with pytest.raises(FileExistsError, match=f"refusing to replace {out}: it appeared while"):
        save_engine(out, {1: toy}, manifest_fields=FIELDS, overwrite=False)
    assert json.loads((out / "manifest.json").read_text())["by"] == "them"
    assert _hidden(tmp_path) == []
    (out / "manifest.json").unlink()
    out.rmdir()
    save_engine(out, {1: toy}, manifest_fields=FIELDS)
    assert "by" not in load_manifest(out)


def test_a_checkpoint_that_appears_during_synth_is_never_replaced(tmp_path, monkeypatch):
    out = tmp_path / "ck"
    real = synth.write_safetensors

    def theirs_appears(*a, **kw):
        if not out.exists():
            out.mkdir()
            (out / "config.json").write_text('{"by": "them"}')
        return real(*a, **kw)

    monkeypatch.setattr(synth, "write_safetensors", theirs_appears)
    with pytest.raises(FileExistsError, match="it appeared while this write ran"):
        synth.synth_checkpoint("tiny", out)
    assert json.loads((out / "config.json").read_text()) == {"by": "them"}
    assert _hidden(tmp_path) == []


@pytest.mark.parametrize("theirs", ["file", "dir"])
def test_move_into_place_without_replace_keeps_what_is_there(tmp_path, theirs):
    tmp, dest = tmp_path / "new", tmp_path / "dest"
    tmp.mkdir()
    if theirs == "file":
        dest.write_text("theirs")
    else:
        dest.mkdir()
        (dest / "x").write_text("theirs")
    with pytest.raises(FileExistsError, match="appeared while this write ran"):
        move_into_place(tmp, dest, replace=False)
    assert (dest if theirs == "file" else dest / "x").read_text() == "theirs"
    empty = tmp_path / "empty"
    empty.mkdir()
    move_into_place(tmp, empty, replace=False)   # an empty directory holds nothing to lose
    assert not tmp.exists() and empty.is_dir()


def test_build_without_overwrite_refuses_an_output_that_is_not_empty(config_only, tmp_path):
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.build.pipeline import build_engine
    out = tmp_path / "engine"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds an engine; pass overwrite=True"):
        build_engine(config_only, out, BuildConfig(buckets=(1,), max_seq_len=64,
                                                   overwrite=False))


def test_dump_graphs_inside_the_output_is_refused_before_loading(config_only, tmp_path, capsys):
    """Graphs dumped into the engine directory made it one of other files, which the write at
    the end refused to replace, after minutes of export."""
    out = tmp_path / "engine"
    for dump in (out, out / "graphs"):
        assert cli.main(["build", str(config_only), "--out", str(out), "--dump-graphs",
                         str(dump), *BUILD]) == 1
        line = _error_line(capsys.readouterr().err, "build")
        assert f"--dump-graphs {dump} is inside --out {out}" in line
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_written_engine_has_a_new_directory_s_mode(toy, tmp_path):
    """The temporary is made 0700 (mkdtemp); the engine it becomes follows the umask like any
    new directory, or a server running as another user could not read it."""
    import stat
    old = os.umask(0o027)
    try:
        save_engine(tmp_path / "engine", {1: toy}, manifest_fields=FIELDS)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "engine").stat().st_mode) == 0o750


# ------------------------------------------------------------------ a full disk
def _need(line: str) -> int:
    return int(re.search(r"needs about ([\d,]+) bytes", line).group(1).replace(",", ""))


def test_build_checks_free_space_once_the_weights_are_loaded(tiny_ckpt, tmp_path, monkeypatch,
                                                             capsys):
    """A build onto a file system smaller than the engine stops after loading the weights (the
    engine's bulk), before minutes of export, naming the output and the bytes."""
    out = tmp_path / "engine"
    monkeypatch.setattr(atomic_dir, "free_bytes", lambda path: 5 << 20)
    assert cli.main(["build", str(tiny_ckpt), "--out", str(out), *BUILD]) == 1
    captured = capsys.readouterr()
    line = _error_line(captured.err, "build")
    assert f"cannot write the engine {out}: it needs about " in line
    assert "its file system has 5,242,880 bytes free" in line
    assert "[load] done" in captured.out and "[export]" not in captured.out
    weights = (tiny_ckpt / "model.safetensors").stat().st_size
    assert weights <= _need(line) <= 2 * weights
    assert os.listdir(tmp_path) == []


def test_save_engine_checks_free_space_before_writing(toy, tmp_path):
    out = tmp_path / "engine"
    weights = sum(p.numel() * p.element_size() for p in Toy().parameters())
    with pytest.raises(NoSpaceError) as e:
        save_engine(out, {1: toy}, manifest_fields=FIELDS, free_bytes=lambda path: 1000)
    assert f"cannot write the engine {out}: it needs about" in str(e.value)
    assert _need(str(e.value)) > weights and "1,000 bytes free" in str(e.value)
    assert os.listdir(tmp_path) == []
    # what it asked for is enough: the same write with that much free succeeds
    save_engine(out, {1: toy}, manifest_fields=FIELDS, free_bytes=lambda path: _need(
        str(e.value)))
    assert sum(p.stat().st_size for p in out.rglob("*")) <= _need(str(e.value))


def _safetensors_error():
    from safetensors import SafetensorError
    return SafetensorError("Error while serializing: I/O error: No space left on device "
                           "(os error 28)")


@pytest.mark.parametrize("raised, says", [
    (lambda: OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    (_safetensors_error, "No space left on device"),        # what safetensors' writer raises
    (lambda: OSError(errno.EDQUOT, "Disk quota exceeded"), "Disk quota exceeded"),
    (lambda: OSError(errno.EROFS, "Read-only file system"), "Read-only file system"),
])
def test_a_write_that_runs_out_of_space_names_the_output(toy, tmp_path, monkeypatch, raised,
                                                         says):
    out = tmp_path / "engine"

    def fails(store, path):
        path.write_bytes(b"\0" * 4096)       # a partial file in the temporary
        raise raised()

    monkeypatch.setattr(artifact, "_save_weights", fails)
    with pytest.raises(NoSpaceError) as e:
        save_engine(out, {1: toy}, manifest_fields=FIELDS)
    msg = str(e.value)
    assert msg.startswith(f"cannot write the engine {out}: {says} (it needs about ") and \
        "\n" not in msg
    assert e.value.__suppress_context__
    assert os.listdir(tmp_path) == []


def test_other_write_errors_pass_through(toy, tmp_path, monkeypatch):
    def fails(store, path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(artifact, "_save_weights", fails)
    with pytest.raises(OSError) as e:
        save_engine(tmp_path / "engine", {1: toy}, manifest_fields=FIELDS)
    assert type(e.value) is OSError and e.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []


def test_synth_on_a_small_disk_is_one_line_before_writing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ck"
    monkeypatch.setattr(atomic_dir, "free_bytes", lambda path: 5 << 20)
    assert cli.main(["synth", "--preset", "tiny", "--out", str(out)]) == 1
    line = _error_line(capsys.readouterr().err, "synth")
    assert f"cannot write the checkpoint {out}: it needs about " in line
    schema = synth.synth_schema(synth._resolve_cfg("tiny"))
    data = sum(synth.nbytes(sp.shape, sp.dtype) for sp in schema.values())
    assert data <= _need(line) <= data + (2 << 20)
    assert os.listdir(tmp_path) == []


def test_synth_that_runs_out_of_space_is_one_line(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ck"
    real = synth.write_safetensors

    def fills_the_disk(path, *a, **kw):
        real(path, *a, **kw)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(synth, "write_safetensors", fills_the_disk)
    assert cli.main(["synth", "--preset", "tiny", "--out", str(out)]) == 1
    line = _error_line(capsys.readouterr().err, "synth")
    assert f"cannot write the checkpoint {out}: No space left on device (it needs about " in line
    assert os.listdir(tmp_path) == []


def test_synth_past_a_real_file_size_limit(tmp_path):
    """A real failing write in a real process: RLIMIT_FSIZE (1 MB) makes the kernel refuse the
    safetensors file's bytes past it (EFBIG), as a full disk refuses them (ENOSPC)."""
    import resource
    out = tmp_path / "ck"

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # EFBIG instead of the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    r = subprocess.run([sys.executable, "-m", "dspark_compile.cli.main", "synth", "--preset", "tiny",
                        "--out", str(out)], capture_output=True, text=True, timeout=300,
                       preexec_fn=limit)
    assert r.returncode == 1
    line = _error_line(r.stderr, "synth")
    assert f"cannot write the checkpoint {out}: File too large (it needs about " in line
    assert os.listdir(tmp_path) == []
