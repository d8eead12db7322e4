"""Misuse at the command line is one line naming the flag, field or file (exit 1), found before
the expensive part: these checkpoints hold only a config.json, so a check that ran after
loading the weights would fail with a different error."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dspark_compile import cli
from dspark_compile.cli_common import COMMANDS, Command
from dspark_compile.models.presets import preset


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
])
@pytest.mark.parametrize("command", ["generate", "run"])
def test_bad_sampling_flags_are_named_before_anything_is_read(tmp_path, capsys, command, flags,
                                                              says):
    # the checkpoint / engine does not even exist: the flags are checked first
    assert cli.main([command, str(tmp_path / "nowhere"), "--prompt-ids", "1,2"] + flags) == 1
    assert says in _one_line(capsys, command)


def test_generate_checks_prompts_and_stop_ids_against_config_json(config_only, capsys):
    assert cli.main(["generate", str(config_only), "--prompt-ids", "1,2", "--prompt-ids",
                     "3,512,9"]) == 1
    assert ("--prompt-ids (prompt 1): token ids [512] outside [0, 512) (the model's vocab_size)"
            in _one_line(capsys, "generate"))
    assert cli.main(["generate", str(config_only), "--prompt-ids", "1", "--stop-ids", "7,600"]) == 1
    assert "--stop-ids: id 600 outside [0, 512)" in _one_line(capsys, "generate")


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
    (["--max-rows", "-2"], "--max-rows must be >= 1, got -2"),
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
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(p for p in os.listdir(tmp_path) if p != "ck") == []   # no temporaries left


def test_synth_removes_a_dead_writers_temporary(tmp_path, capsys):
    from dspark_compile.models.atomic_dir import temp_dir
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
    assert cli.main(["probe", "--threads", "2"]) == 0 and seen[-1] == 2
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
    from dspark_compile.versions import package_version
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"dspark-compile {package_version()} (torch {torch.__version__}, triton ")


def test_cli_modules_do_not_import_each_other():
    """cli_engine imports cli_common only; cli imports both (one direction)."""
    r = subprocess.run([sys.executable, "-c", "import sys, dspark_compile.cli_engine; "
                        "print('dspark_compile.cli' in sys.modules)"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_generate_hint_names_the_flag_not_the_python_argument(tmp_path, capsys):
    """A config with the draft over weights without it: the loader's hint says
    include_draft=False; at the CLI that is --no-speculation."""
    from dspark_compile.models.synth import synth_checkpoint
    ck = synth_checkpoint("tiny", tmp_path / "ck", include_draft=False)
    (ck / "config.json").write_text(json.dumps(preset("tiny")))
    assert cli.main(["generate", str(ck), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 1
    line = _one_line(capsys, "generate")
    assert "--no-speculation" in line and "include_draft" not in line
