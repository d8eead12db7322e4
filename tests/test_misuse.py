"""Misuse at the command line is one line naming the flag, field or file (exit 1), found before
the expensive part: these checkpoints hold only a config.json, so a check that ran after
loading the weights would fail with a different error."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from dspark_compile.cli import main as cli
from dspark_compile.cli.common import COMMANDS, Command
from dspark_compile.factory.presets import preset


def _one_line(capsys, command: str) -> str:
    return _error_line(capsys.readouterr().err, command)


def _error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"dspark-compile {command}: error: "), err
    return lines[0]


@pytest.fixture
def config_only(tmp_path):
    """A checkpoint directory with the tiny config.json and no weights."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(preset("tiny")))
    return d


# ------------------------------------------------------------------ sampling flags (generate, run)
@pytest.mark.parametrize("flags, says", [
    (["--temperature", "inf"], "--temperature must be a finite number >= 0 (0 = greedy), got inf"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--top-k", "-3"], "--top-k must be >= 0 (0 = off), got -3"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--seed", str(1 << 63)], "--seed must fit in 64 bits"),
    # beyond what the decode state holds (issue 50: a traceback, or "Overflow when unpacking
    # long long" with no flag named)
    (["--temperature", "1e39"], "--temperature must be <= 3.4028234663852886e+38 (the largest "
                                "float32, as the decode state holds it), got 1e+39"),
    (["--temperature", "1e400"], "--temperature must be a finite number >= 0 (0 = greedy), "
                                 "got inf"),
    (["--top-k", str(1 << 63)], f"--top-k must be <= {(1 << 63) - 1} (the decode state holds "
                                "it as int64"),
    (["--top-k", "1" + "0" * 40], f"--top-k must be <= {(1 << 63) - 1}"),
    (["--max-new-tokens", str(1 << 63)], f"--max-new-tokens must be <= {(1 << 63) - 1} "
                                         "(positions are int64)"),
    (["--seed", str(-(1 << 63) - 1)], "--seed must fit in 64 bits"),
    (["--seed", str((1 << 63) - 1), "--prompt-ids", "3"],
     f"--seed + 1 (what prompt 1 samples with) must fit in 64 bits (a signed int64), got "
     f"{1 << 63}"),
])
@pytest.mark.parametrize("command", ["generate", "run"])
def test_bad_sampling_flags_are_named_before_anything_is_read(tmp_path, capsys, command, flags,
                                                              says):
    # the checkpoint / engine does not even exist: the flags are checked first
    assert cli.main([command, str(tmp_path / "nowhere"), "--prompt-ids", "1,2"] + flags) == 1
    assert says in _one_line(capsys, command)


@pytest.mark.parametrize("flags, says", [
    (["--max-new-tokens", "1" + "0" * 30], "--max-new-tokens must be <= 9223372036854775807"),
    (["--max-new-tokens", "5000"], "--prompt-ids (prompt 0): 2 tokens + --max-new-tokens 5000 "
                                   "need 5009 positions"),
    (["--prompt-ids", "1," + "9" * 30], f"token ids [{'9' * 30}] outside [0, 512)"),
    (["--stop-ids", "1" + "0" * 30], "--stop-ids must be token ids in [0, 512), got 1" + "0" * 30),
])
def test_numbers_beyond_the_model_are_named_before_loading(config_only, capsys, flags, says):
    assert cli.main(["generate", str(config_only), "--prompt-ids", "1,2"] + flags) == 1
    assert says in _one_line(capsys, "generate")


SHARD = "--shard-size must be a positive number of MB"


@pytest.mark.parametrize("argv, says", [
    (["synth", "--preset", "tiny", "--shard-size", "1e308"],
     "--shard-size must be a positive number of MB, from 9.54e-07 (one byte) to 1099511627776, "
     "got 1e+308"),
    (["synth", "--preset", "tiny", "--shard-size", "1e-300"], SHARD),
    (["synth", "--preset", "tiny", "--shard-size", "nan"], SHARD),
    (["synth", "--preset", "tiny", "--shard-size=-inf"], SHARD),
    (["synth", "--preset", "tiny", "--seed", "9" * 30], "--seed must fit in 64 bits"),
])
def test_numeric_synth_flags_out_of_range_are_one_line(tmp_path, capsys, argv, says):
    assert cli.main(argv + ["--out", str(tmp_path / "ck")]) == 1
    assert says in _one_line(capsys, "synth")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("flags, says", [
    (["--max-seq-len", "9" * 30], f"--max-seq-len={'9' * 30} exceeds the model's "
                                  "max_position_embeddings=4096"),
    (["--max-rows", "9" * 30], f"--max-rows={'9' * 30} rows"),
    (["--buckets", "1," + "9" * 30], "--buckets up to " + "9" * 30),
    (["--threads", "9" * 30], "argument --threads: must be <= "),
])
def test_numeric_build_flags_beyond_any_machine_are_one_line(config_only, tmp_path, capsys,
                                                            flags, says):
    out = tmp_path / "engine"
    try:            # argparse's usage errors exit 2, the command's own errors return 1
        assert cli.main(["build", str(config_only), "--out", str(out)] + flags) == 1
    except SystemExit as e:
        assert e.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert not out.exists()


def test_generate_checks_prompts_and_stop_ids_against_config_json(config_only, capsys):
    assert cli.main(["generate", str(config_only), "--prompt-ids", "1,2", "--prompt-ids",
                     "3,512,9"]) == 1
    assert ("--prompt-ids (prompt 1): token ids [512] outside [0, 512) (the model's vocab_size)"
            in _one_line(capsys, "generate"))
    assert cli.main(["generate", str(config_only), "--prompt-ids", "1", "--stop-ids", "7,600"]) == 1
    assert "--stop-ids must be token ids in [0, 512), got 600" in _one_line(capsys, "generate")


def test_generate_without_a_draft_names_no_speculation(config_only, capsys):
    raw = {k: v for k, v in preset("tiny").items() if not k.startswith("dspark_")}
    (config_only / "config.json").write_text(json.dumps(raw))
    assert cli.main(["generate", str(config_only), "--prompt-ids", "1"]) == 1
    assert "pass --no-speculation" in _one_line(capsys, "generate")


# ------------------------------------------------------------------ build options
@pytest.mark.parametrize("flags, says", [
    (["--max-seq-len", "-5"], "--max-seq-len must be an int >= 9 (a 1-token prompt, 1 new token "
                              "and the draft block of 5 with its lookahead), got -5"),
    (["--max-seq-len", "0"], "--max-seq-len must be an int >= 9"),
    (["--max-seq-len", "8"], "--max-seq-len must be an int >= 9"),
    (["--disable-pass", "nosuch"], "--disable-pass: unknown pass 'nosuch'; known passes: "),
    (["--arch", "sm_999"], "--arch must be one of "),
    (["--max-rows", "-2"], "--max-rows must be >= 1 (leave it out for the largest bucket), got -2"),
    (["--max-rows", "0"], "--max-rows must be >= 1 (leave it out for the largest bucket), got 0"),
    (["--compile-workers", "-1"], "--compile-workers must be >= 0 (0: one per core), got -1"),
    (["--max-seq-len", "5000"], "--max-seq-len=5000 exceeds the model's max_position_embeddings="
                                "4096 (config.json)"),
    (["--max-rows", "3", "--buckets", "1,4"], "--max-rows must be >= the largest bucket (4), got 3"),
])
def test_bad_build_options_are_named_before_loading(config_only, tmp_path, capsys, flags, says):
    out = tmp_path / "engine"
    assert cli.main(["build", str(config_only), "--out", str(out)] + flags) == 1
    captured = capsys.readouterr()
    assert says in _error_line(captured.err, "build")
    assert "[load]" not in captured.out          # refused before the checkpoint was loaded
    assert not out.exists()


def test_unknown_pass_lists_the_known_ones(config_only, tmp_path, capsys):
    from dspark_compile.passes import REGISTRY
    assert cli.main(["build", str(config_only), "--out", str(tmp_path / "e"),
                     "--disable-pass", "nosuch"]) == 1
    assert _one_line(capsys, "build").endswith(", ".join(REGISTRY.names()))


def test_dump_graphs_onto_a_file(config_only, tmp_path, capsys):
    f = tmp_path / "graphs"
    f.write_text("x")
    assert cli.main(["build", str(config_only), "--out", str(tmp_path / "e"),
                     "--dump-graphs", str(f)]) == 1
    assert f"--dump-graphs: {f} exists and is not a directory" in _one_line(capsys, "build")


def test_build_config_not_utf8_names_the_file(config_only, tmp_path, capsys):
    (config_only / "config.json").write_bytes(b'{"vocab_size": "\xff"}')
    assert cli.main(["build", str(config_only), "--out", str(tmp_path / "e")]) == 1
    assert f"{config_only / 'config.json'} is not UTF-8 text" in _one_line(capsys, "build")


# ------------------------------------------------------------------ what --overwrite may replace
def test_build_replaces_an_engine_only_with_overwrite(config_only, tmp_path, capsys):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    assert cli.main(["build", str(config_only), "--out", str(out), "--max-seq-len", "0"]) == 1
    assert f"--out {out} already holds an engine; pass --overwrite to replace it" in \
        _one_line(capsys, "build")
    (out / "notes.txt").write_text("mine")
    assert cli.main(["build", str(config_only), "--out", str(out), "--overwrite"]) == 1
    line = _one_line(capsys, "build")
    assert "it holds more than an engine: ['notes.txt'], which replacing it would delete" in line
    assert (out / "notes.txt").read_text() == "mine"


def test_synth_overwrite_refuses_a_directory_of_other_files(tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    assert cli.main(["synth", "--preset", "tiny", "--out", str(out), "--overwrite"]) == 1
    line = _one_line(capsys, "synth")
    assert f"refusing to replace {out}: it is not a checkpoint directory (no config.json)" in line
    (out / "config.json").write_text("{}")
    assert cli.main(["synth", "--preset", "tiny", "--out", str(out), "--overwrite"]) == 1
    assert "it holds more than a checkpoint: ['thesis.tex']" in _one_line(capsys, "synth")
    assert (out / "thesis.tex").read_text() == "years of work"
    # without --overwrite the flag is named, not the Python argument
    assert cli.main(["synth", "--preset", "tiny", "--out", str(out)]) == 1
    line = _one_line(capsys, "synth")
    assert "(pass --overwrite to replace it)" in line and "overwrite=True" not in line


def test_synth_overwrite_replaces_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "ck"
    assert cli.main(["synth", "--preset", "tiny", "--out", str(out), "--seed", "1"]) == 0
    assert cli.main(["synth", "--preset", "tiny", "--out", str(out), "--overwrite"]) == 0
    assert sorted(set(os.listdir(out)) - {"tokenizer.json"}) == ["config.json",
                                                                 "model.safetensors"]
    assert sorted(p for p in os.listdir(tmp_path) if p != "ck") == []   # no temporaries left


def test_synth_removes_a_dead_writers_temporary(tmp_path, capsys):
    from dspark_compile.atomic_dir import temp_dir
    out = tmp_path / "ck"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = temp_dir(out)
    stale.rename(stale.with_name(stale.name.replace(f"-{os.getpid()}-", f"-{dead.pid}-")))
    live = temp_dir(out)                 # this process's: a concurrent writer
    assert cli.main(["synth", "--preset", "tiny", "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ck", live.name])


# ------------------------------------------------------------------ process-level options
def _probe(monkeypatch, fn):
    monkeypatch.setitem(COMMANDS, "probe", Command("probe", "test", lambda p: None, fn))


def test_threads_is_applied_and_restored(monkeypatch):
    seen = []
    _probe(monkeypatch, lambda args: seen.append(torch.get_num_threads()) or 0)
    before = torch.get_num_threads()
    assert cli.main(["probe"]) == 0 and seen == [cli.DEFAULT_THREADS]
    n = cli.max_threads()                 # 2 on the CI machine: not the default of 1 there
    assert cli.main(["probe", "--threads", str(n)]) == 0 and seen[-1] == n
    assert torch.get_num_threads() == before


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["synth", "--preset", "tiny", "--out", "x", "--threads", "0"])
    assert e.value.code == 2
    assert "argument --threads: must be >= 1, got 0" in capsys.readouterr().err


def test_sigterm_exits_143_after_cleanup(monkeypatch, capsys):
    cleaned = []

    def run(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)             # the handler interrupts it
            return 0
        finally:
            cleaned.append(True)

    _probe(monkeypatch, run)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["probe"]) == 143
    assert cleaned == [True]
    assert capsys.readouterr().err.strip() == "dspark-compile probe: terminated"
    assert signal.getsignal(signal.SIGTERM) is before


def test_version(capsys):
    from dspark_compile.engine_dir.versions import package_version
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"dspark-compile {package_version()} (torch {torch.__version__}, triton ")


def test_cli_modules_do_not_import_each_other():
    """cli_engine imports cli_common only; cli imports both (one direction)."""
    r = subprocess.run([sys.executable, "-c", "import sys, dspark_compile.cli.engine_commands; "
                        "print('dspark_compile.cli.main' in sys.modules)"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_generate_hint_names_the_flag_not_the_python_argument(tmp_path, capsys):
    """A config with the draft over weights without it: the loader's hint says
    include_draft=False; at the CLI that is --no-speculation."""
    from dspark_compile.factory.synth import synth_checkpoint
    ck = synth_checkpoint("tiny", tmp_path / "ck", include_draft=False)
    (ck / "config.json").write_text(json.dumps(preset("tiny")))
    assert cli.main(["generate", str(ck), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 1
    line = _one_line(capsys, "generate")
    assert "--no-speculation" in line and "include_draft" not in line


# ================================================================== issue 32: the second pass
# ------------------------------------------------------------------ --overwrite never deletes a
# user's file, wherever in the tree it is (a property over random trees)
def _tree(root) -> dict:
    """Every entry under `root`: relative path -> file bytes, 'dir' or 'link -> target'."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = f"link -> {os.readlink(p)}"
            elif os.path.isdir(p):
                out[rel] = "dir"
            else:
                with open(p, "rb") as f:
                    out[rel] = f.read()
    return out


_ENGINE_FILES = ("programs/step_b1.json", "programs/step_b2.json", "programs/prefill_c64.json",
                 "weights.safetensors", "kernels/sm_120/resources.json", "tokenizer.json",
                 "compiled/step_b1.full.pt2")


def _fake_engine(root):
    """An engine directory as save_engine leaves it: its files and a manifest listing them."""
    root.mkdir(parents=True)
    for rel in _ENGINE_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rel.encode())
    (root / "manifest.json").write_text(json.dumps(
        {"files": {rel: {"sha256": "0" * 64, "size": len(rel)} for rel in _ENGINE_FILES}}))


def _fake_checkpoint(root):
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(preset("tiny")))
    (root / "model.safetensors").write_bytes(b"weights")


def _add_user_files(root, rng):
    """1-3 user entries at random depths: files (some named like the writer's own, in places
    it never writes them), empty directories, symbolic links."""
    dirs = sorted({str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()} | {"."})
    names = ["mine.txt", "notes.md", "step_b4.json", "model.safetensors", "config.json",
             "weights.safetensors", "resources.json", ".hidden"]
    added = []
    for _ in range(rng.randint(1, 3)):
        base = root / rng.choice(dirs)
        for _ in range(rng.randint(0, 2)):           # sometimes a new subdirectory
            base = base / rng.choice(["sub", "x", "programs", "data"])
        base.mkdir(parents=True, exist_ok=True)
        kind = rng.choice(["file", "file", "file", "empty_dir", "link"])
        target = base / rng.choice(names)
        if target.exists() or target.is_symlink() or (
                base == root and target.name.endswith(".safetensors")):   # a checkpoint's own
            continue
        if kind == "file":
            target.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(0, 16))))
        elif kind == "empty_dir":
            target.mkdir()
        else:
            target.symlink_to(root.parent / "elsewhere")
        added.append(target)
    if not added:                                    # every tree gets at least one
        (root / "sub").mkdir(exist_ok=True)
        added.append(root / "sub" / "mine.txt")
        added[-1].write_text("mine")
    return added


def test_a_plain_engine_and_checkpoint_may_be_replaced(tmp_path):
    """The control of the property below: without user files --overwrite is allowed."""
    from dspark_compile.engine_dir.write import not_an_engine
    from dspark_compile.factory.synth import _not_a_checkpoint
    _fake_engine(tmp_path / "engine")
    _fake_checkpoint(tmp_path / "ck")
    assert not_an_engine(tmp_path / "engine") is None
    assert _not_a_checkpoint(tmp_path / "ck") is None


@pytest.mark.parametrize("seed", range(20))
def test_overwrite_refuses_any_tree_holding_user_files_and_removes_nothing(tmp_path, capsys,
                                                                           config_only, seed):
    import random
    rng = random.Random(seed)
    (tmp_path / "elsewhere").write_text("a link's target")
    eng, ck = tmp_path / "engine", tmp_path / "ck"
    _fake_engine(eng)
    _fake_checkpoint(ck)
    _add_user_files(eng, rng)
    _add_user_files(ck, rng)
    before = (_tree(eng), _tree(ck), sorted(os.listdir(tmp_path)))
    assert cli.main(["build", str(config_only), "--out", str(eng), "--overwrite"]) == 1
    line = _one_line(capsys, "build")
    assert f"--out {eng}: it holds more than an engine" in line, line
    assert cli.main(["synth", "--preset", "tiny", "--out", str(ck), "--overwrite"]) == 1
    line = _one_line(capsys, "synth")
    assert f"refusing to replace {ck}: it holds more than a checkpoint" in line, line
    assert (_tree(eng), _tree(ck), sorted(os.listdir(tmp_path))) == before


def test_overwrite_names_the_user_file_below_the_top_level(tmp_path, config_only, capsys):
    eng = tmp_path / "engine"
    _fake_engine(eng)
    (eng / "programs" / "mine.txt").write_text("mine")
    assert cli.main(["build", str(config_only), "--out", str(eng), "--overwrite"]) == 1
    assert ("it holds more than an engine: ['programs/mine.txt'], which replacing it would "
            "delete") in _one_line(capsys, "build")
    assert (eng / "programs" / "mine.txt").read_text() == "mine"


def test_overwrite_refuses_an_engine_whose_manifest_cannot_be_read(tmp_path, config_only, capsys):
    eng = tmp_path / "engine"
    _fake_engine(eng)
    (eng / "manifest.json").write_text("{not json")
    assert cli.main(["build", str(config_only), "--out", str(eng), "--overwrite"]) == 1
    assert "its manifest.json cannot be read (JSONDecodeError), so which files are the engine's " \
           "cannot be told" in _one_line(capsys, "build")
    assert (eng / "weights.safetensors").is_file()


# ------------------------------------------------------------------ --threads
@pytest.mark.parametrize("argv", [["synth", "--preset", "tiny", "--out", "OUT"],
                                  ["run", "OUT", "--prompt-ids", "1"], ["inspect", "OUT"],
                                  ["generate", "OUT", "--prompt-ids", "1"], ["build", "CK", "--out", "OUT"]])
def test_threads_beyond_the_cpu_count_are_refused_before_anything_runs(tmp_path, capsys, argv):
    """100000 threads segfaulted (exit 139) in libgomp at the first parallel op, and synth left
    its temporary directory behind."""
    argv = [str(tmp_path / "x") if a in ("OUT", "CK") else a for a in argv]
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--threads", "100000"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert (f"argument --threads: must be <= {os.cpu_count()} (os.cpu_count(), the CPUs of this "
            "machine), got 100000") in last
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ sizes nobody can allocate
def test_state_bytes_is_what_allocate_state_allocates():
    from dspark_compile.models.config import CacheConfig, ModelConfig, Precision
    from dspark_compile.models.state import allocate_state, state_bytes
    cfg = ModelConfig.from_dict(preset("tiny"))
    for prec in (Precision(dtype=torch.float32), Precision(dtype=torch.float64, kv_fp8=False)):
        cache = CacheConfig(max_rows=3, max_seq_len=40, max_step_tokens=16)
        state = allocate_state(cfg, cache, prec)
        assert state_bytes(cfg, cache, prec) == sum(t.numel() * t.element_size()
                                                    for t in state.values())


@pytest.mark.parametrize("flags, sizes", [
    (["--buckets", "100000000"], "--max-rows=100000000 rows (--buckets up to 100000000)"),
    (["--max-rows", "100000000"], "--max-rows=100000000 rows (--buckets up to 64)"),
    (["--max-seq-len", "1000000000"], "--max-rows=64 rows (--buckets up to 64), "
                                      "--max-seq-len=1000000000 positions"),
])
def test_a_state_nobody_can_allocate_is_refused_with_its_bytes(config_only, tmp_path, capsys,
                                                               flags, sizes):
    """The state's bytes from the layout before allocating: the flag, the number and the free
    memory (was: DefaultCPUAllocator: can't allocate memory, from allocate_state)."""
    raw = preset("tiny")
    raw["max_position_embeddings"] = 1 << 31     # so that --max-seq-len reaches the state check
    (config_only / "config.json").write_text(json.dumps(raw))
    assert cli.main(["build", str(config_only), "--out", str(tmp_path / "e"), "--device", "cpu"]
                    + flags) == 1
    line = _one_line(capsys, "build")
    assert f"the decode state for {sizes}" in line, line
    assert " bytes (" in line and "TiB); cpu has " in line and "available (MemAvailable" in line
    assert not (tmp_path / "e").exists()


def test_generate_refuses_a_state_nobody_can_allocate(config_only, capsys):
    raw = preset("tiny")
    raw["max_position_embeddings"] = 1 << 40
    (config_only / "config.json").write_text(json.dumps(raw))
    assert cli.main(["generate", str(config_only), "--prompt-ids", "1",
                     "--max-new-tokens", str(1 << 36)]) == 1
    line = _one_line(capsys, "generate")
    assert "the decode state for 1 prompts of up to" in line and "cpu has " in line


# ------------------------------------------------------------------ output paths, checked first
needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


@needs_proc
@pytest.mark.parametrize("flags, says", [
    (["--dump-graphs", "/proc/nope"], "--dump-graphs: cannot write /proc/nope: /proc is not "
                                      "writable"),
    (["--out", "/proc/e"], "--out: cannot write /proc/e: /proc is not writable"),
])
def test_build_outputs_that_cannot_be_written_are_named_before_loading(config_only, tmp_path,
                                                                       capsys, flags, says):
    argv = ["build", str(config_only), "--out", str(tmp_path / "e")] + flags
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert says in _error_line(captured.err, "build")
    assert "[load]" not in captured.out


@pytest.mark.parametrize("where, says", [
    ("dir", "--report: {p} is a directory, not a file name"),
    ("under_file", "--report: cannot write {p}: {f} is not a directory"),
    pytest.param("proc", "--report: cannot write {p}: /proc is not writable", marks=needs_proc),
])
def test_inspect_report_path_is_checked_before_the_summary(tmp_path, capsys, where, says):
    f = tmp_path / "afile"
    f.write_text("x")
    p = {"dir": tmp_path, "under_file": f / "r.html", "proc": "/proc/r.html"}[where]
    # the engine does not exist: the output path is refused before it is read
    assert cli.main(["inspect", str(tmp_path / "nowhere"), "--report", str(p)]) == 1
    captured = capsys.readouterr()
    assert says.format(p=p, f=f) in _error_line(captured.err, "inspect")
    assert captured.out == ""


def test_inspect_onnx_dir_under_a_file_is_checked_first(tmp_path, capsys):
    pytest.importorskip("onnx")
    f = tmp_path / "afile"
    f.write_text("x")
    assert cli.main(["inspect", str(tmp_path / "nowhere"), "--onnx", str(f / "o")]) == 1
    captured = capsys.readouterr()
    assert f"--onnx: cannot create {f / 'o'}: {f} is not a directory" in _error_line(
        captured.err, "inspect")
    assert captured.out == ""


def test_synth_out_under_a_file_names_the_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    assert cli.main(["synth", "--preset", "tiny", "--out", str(f / "ck")]) == 1
    assert f"--out: cannot create {f / 'ck'}: {f} is not a directory" in _one_line(capsys, "synth")
    assert cli.main(["synth", "--preset", "tiny", "--out", str(f)]) == 1
    assert f"--out {f} exists and is not a directory" in _one_line(capsys, "synth")
    assert sorted(os.listdir(tmp_path)) == ["afile"]


@pytest.mark.parametrize("command", ["run", "inspect"])
def test_an_engine_path_that_is_a_file_or_whose_manifest_is_a_directory(tmp_path, capsys,
                                                                        command):
    extra = ["--prompt-ids", "1"] if command == "run" else []
    f = tmp_path / "engine_file"
    f.write_text("x")
    assert cli.main([command, str(f)] + extra) == 1
    assert f"engine directory {f} is not a directory" in _one_line(capsys, command)
    d = tmp_path / "engine"
    (d / "manifest.json").mkdir(parents=True)
    assert cli.main([command, str(d)] + extra) == 1
    assert f"{d} is not an engine: manifest.json is not a file" in _one_line(capsys, command)


# ------------------------------------------------------------------ accepted only by a stated rule
def test_token_id_lists_follow_the_stated_rule(capsys):
    from dspark_compile.cli.engine_commands import IDS_RULE, _ids
    assert _ids(" 1, 2 ") == [1, 2]                  # spaces around an id: ignored
    for bad, says in (("1,,2", "empty item in '1,,2'"), ("1,2,", "empty item in '1,2,'"),
                      ("-3", "token ids must be >= 0, got -3"), ("", "no token ids given"),
                      ("1,x", "expected comma-separated token ids >= 0")):
        with pytest.raises(Exception, match=re.escape(says)):
            _ids(bad)
    for command in ("run", "generate"):
        parser = cli.build_parser()
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        assert IDS_RULE in " ".join(sub.format_help().split())


@pytest.mark.parametrize("flag, value, says", [
    ("--prompt-ids", "1,,2", "argument --prompt-ids: empty item in '1,,2'"),
    ("--stop-ids", "-3", "argument --stop-ids: token ids must be >= 0, got -3"),
])
def test_bad_id_lists_are_usage_errors_naming_the_flag(tmp_path, capsys, flag, value, says):
    argv = ["generate", str(tmp_path), "--prompt-ids", "1"]
    with pytest.raises(SystemExit) as e:
        cli.main(argv + [flag, value])
    assert e.value.code == 2
    assert says in capsys.readouterr().err.strip().splitlines()[-1]


def test_generate_refuses_a_prompt_past_max_position_embeddings(config_only, capsys):
    """It ran and printed `steps: 0`."""
    long = ",".join(["3"] * 4100)
    assert cli.main(["generate", str(config_only), "--prompt-ids", long]) == 1
    assert ("--prompt-ids (prompt 0): 4100 tokens leave no room for a new token: with one they "
            "need 4108 positions (with the draft block of 5 and its lookahead); the model's "
            "max_position_embeddings is 4096 (config.json)") in _one_line(capsys, "generate")


def test_synth_seed_has_run_s_range(tmp_path, capsys):
    assert cli.main(["synth", "--preset", "tiny", "--out", str(tmp_path / "ck"),
                     "--seed", str(10 ** 23)]) == 1
    assert "--seed must fit in 64 bits" in _one_line(capsys, "synth")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ help states every default
def _subparsers():
    parser = cli.build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


def test_every_option_with_a_default_states_it_in_help():
    import argparse
    for name, sub in _subparsers().items():
        for a in sub._actions:
            if not a.option_strings or a.required or isinstance(a, argparse._HelpAction):
                continue
            if a.default in (None, False, [], argparse.SUPPRESS):
                continue
            assert a.help and "default" in a.help, (name, a.option_strings, a.help)


@pytest.mark.parametrize("command, says", [
    ("build", ["bfloat16 on CUDA, float32 on the CPU", "default 1024", "default auto",
               "aten (the default, every device)", "cuda when this machine has a CUDA device"]),
    ("run", ["(default 32)", "default: the device the engine was built for"]),
    ("generate", ["(default 32)", "compute dtype (default float32)"]),
])
def test_help_shows_the_defaults_the_issue_names(command, says):
    text = " ".join(_subparsers()[command].format_help().split())
    for s in says:
        assert s in text, s


# ------------------------------------------------------------------ build's defaults (issue 31)
def _built_config(monkeypatch, argv):
    """The BuildConfig `build` hands to build_engine (which is not run)."""
    import dspark_compile.cli.engine_commands as commands     # where `build` finds it
    seen = []
    monkeypatch.setattr(commands, "build_engine", lambda ckpt, out, bc, log: seen.append(bc))
    assert cli.main(argv) == 0
    return seen[0]


def test_build_defaults_on_a_machine_without_cuda(monkeypatch, tmp_path, capsys):
    from dspark_compile.engine_dir.build_config import DEFAULT_BUCKETS
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bc = _built_config(monkeypatch, ["build", "CK", "--out", str(tmp_path / "e")])
    assert capsys.readouterr().out.splitlines() == [
        "build: no CUDA device on this machine: building for the CPU (--device cpu)"]
    assert (bc.device, bc.dtype, bc.backend, bc.max_seq_len, bc.buckets, bc.max_rows) == \
        ("cpu", "float32", "aten", 1024, DEFAULT_BUCKETS, 64)
    assert bc.prefill_chunks == (64, 128, 256, 512)
    bc = _built_config(monkeypatch, ["build", "CK", "--out", str(tmp_path / "e"), "--device",
                                     "cpu", "--max-seq-len", "160", "--prefill-chunks", "auto"])
    assert bc.prefill_chunks == (64, 128) and capsys.readouterr().out == ""
    for none in ("none", "0"):
        bc = _built_config(monkeypatch, ["build", "CK", "--out", str(tmp_path / "e"),
                                         "--prefill-chunks", none, "--device", "cpu"])
        assert bc.prefill_chunks == ()


def test_build_defaults_on_a_cuda_machine(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    bc = _built_config(monkeypatch, ["build", "CK", "--out", str(tmp_path / "e")])
    assert (bc.device, bc.dtype, bc.backend) == ("cuda", "bfloat16", "aten")
    assert capsys.readouterr().out == ""        # no line: the GPU is the default
    bc = _built_config(monkeypatch, ["build", "CK", "--out", str(tmp_path / "e"), "--device",
                                     "cpu", "--backend", "inductor", "--compile-workers", "2"])
    assert (bc.device, bc.dtype, bc.backend, bc.compile_workers) == \
        ("cpu", "float32", "inductor", 2)


def test_default_prefill_chunks_rule():
    from dspark_compile.engine_dir.build_config import BuildConfig, default_prefill_chunks
    assert default_prefill_chunks(9) == () and default_prefill_chunks(63) == ()
    assert default_prefill_chunks(64) == (64,) and default_prefill_chunks(200) == (64, 128)
    assert default_prefill_chunks(1024) == default_prefill_chunks(1 << 20) == (64, 128, 256, 512)
    assert BuildConfig(max_seq_len=300, prefill_chunks="auto").prefill_chunks == (64, 128, 256)
    assert BuildConfig().prefill_chunks == ()   # the library's default: explicit, none


@pytest.mark.parametrize("content, says", [
    ("{not json", "tokenizer.json is not a readable JSON file (JSONDecodeError"),
    (None, "tokenizer.json is not a file"),
])
def test_a_bad_checkpoint_tokenizer_is_named_before_loading(config_only, tmp_path, capsys,
                                                            content, says):
    tok = config_only / "tokenizer.json"
    if content is None:
        tok.mkdir()
    else:
        tok.write_text(content)
    assert cli.main(["build", str(config_only), "--out", str(tmp_path / "e"), "--device",
                     "cpu"]) == 1
    captured = capsys.readouterr()
    assert says in _error_line(captured.err, "build") and "[load]" not in captured.out


# ------------------------------------------------------------------ found by the 50 more inputs
@pytest.mark.parametrize("argv, command", [
    (["synth", "--preset", "tiny", "--out", "OUT", "--device", "meta"], "synth"),
    (["build", "CK", "--out", "OUT", "--device", "meta"], "build"),
    (["generate", "CK", "--prompt-ids", "1", "--device", "meta"], "generate"),
    (["run", "OUT", "--prompt-ids", "1", "--device", "meta"], "run"),
])
def test_devices_other_than_cpu_and_cuda_are_named(tmp_path, config_only, capsys, argv, command):
    """synth --device meta was a traceback; build --device meta exported for minutes first."""
    argv = [str(config_only) if a == "CK" else str(tmp_path / "o") if a == "OUT" else a
            for a in argv]
    assert cli.main(argv) == 1
    assert "--device 'meta': only cpu and cuda devices are supported" in _one_line(capsys, command)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv", [["synth", "--preset", "tiny", "--out", ""],
                                  ["build", "", "--out", "e"], ["build", "ck", "--out", " "],
                                  ["run", "", "--prompt-ids", "1"], ["inspect", ""],
                                  ["inspect", "e", "--report", ""]])
def test_empty_paths_are_usage_errors(capsys, argv):
    """`synth --out ''` said the current directory `.` was not empty."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(": empty path")


@pytest.mark.parametrize("command", ["build", "generate"])
def test_a_checkpoint_that_is_a_file_is_named(tmp_path, capsys, command):
    f = tmp_path / "ck"
    f.write_text("x")
    argv = [command, str(f)] + (["--out", str(tmp_path / "e")] if command == "build"
                                else ["--prompt-ids", "1"])
    assert cli.main(argv) == 1
    assert f"checkpoint {f} is not a directory" in _one_line(capsys, command)
