"""`dspark-compile` CLI: the subcommand table, `synth`, and one-line errors with exit status."""
import os
import subprocess
import sys

import pytest

from dspark_compile.cli import main as cli
from dspark_compile.models.checkpoint import load_checkpoint


def test_every_registered_command_is_a_subcommand():
    assert "synth" in cli.COMMANDS
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(cli.COMMANDS)
    with pytest.raises(RuntimeError, match="registered twice"):
        cli.command("synth", "again", lambda p: None)(lambda a: 0)


def test_synth_single_and_sharded(tmp_path, capsys):
    assert cli.main(["synth", "--preset", "tiny", "--out", str(tmp_path / "one"), "--seed", "3"]) == 0
    assert "wrote tiny checkpoint" in capsys.readouterr().out
    assert sorted(set(os.listdir(tmp_path / "one")) - {"tokenizer.json"}) == [
        "config.json", "model.safetensors"]
    assert cli.main(["synth", "--preset", "tiny", "--out", str(tmp_path / "many"),
                     "--shard-size", "2.5"]) == 0
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    _, a = load_checkpoint(tmp_path / "one")
    _, b = load_checkpoint(tmp_path / "many")
    assert a.keys() == b.keys()
    assert not (a["embed.weight"] == b["embed.weight"]).all()  # seed 3 vs seed 0


@pytest.mark.parametrize("args,match", [
    (["--shard-size", "0"], "--shard-size must be a positive number of MB"),
    (["--shard-size", "-4"], "--shard-size must be a positive number of MB"),
    (["--device", "nonsense"], "--device 'nonsense' is not a torch device"),
])
def test_synth_bad_values_exit_1_with_one_line(tmp_path, capsys, args, match):
    rc = cli.main(["synth", "--preset", "tiny", "--out", str(tmp_path / "x")] + args)
    err = capsys.readouterr().err
    assert rc == 1 and match in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_synth_existing_out_exit_1(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("keep")
    assert cli.main(["synth", "--preset", "tiny", "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and err.count("\n") == 1
    assert os.listdir(tmp_path / "x") == ["f"]


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["synth", "--preset", "flash-0731", "--out", "x"], ["nope"],
                 ["synth", "--out", "x"]):
        with pytest.raises(SystemExit) as ei:
            cli.main(argv)
        assert ei.value.code == 2
    capsys.readouterr()


def test_console_entry_point_in_fresh_process(tmp_path):
    """Exit status and stderr as a user sees them (no traceback)."""
    out = tmp_path / "ck"
    out.mkdir()
    (out / "f").write_text("x")
    r = subprocess.run([sys.executable, "-c", "import sys; from dspark_compile.cli.main import main; "
                        "sys.exit(main())", "synth", "--preset", "tiny", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.startswith("dspark-compile synth: error:") and "Traceback" not in r.stderr
