"""`dspark-compile serve`'s command line: flags checked before anything loads, one-line errors,
and the CLI starts without the extra (fastapi is imported only when `serve` runs)."""
import importlib.util
import socket
import subprocess
import sys

import pytest

from dspark_compile.cli.main import main
from dspark_compile.serve.server import _bind


def test_cli_imports_nothing_of_the_extra_at_start_up():
    code = ("import sys, dspark_compile.cli.main as c; assert 'serve' in c.COMMANDS; "
            "print([m for m in ('fastapi', 'uvicorn', 'prometheus_client', 'starlette') "
            "if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--port", "x"], ["--max-queue", "-1"],
                                  ["--max-request-bytes", "0"], ["--header-timeout", "0"],
                                  ["--body-timeout", "nan"], ["--send-timeout", "inf"],
                                  ["--drain-timeout", "-1"], ["--drain-timeout", "soon"]])
def test_bad_flags_are_usage_errors(argv, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path), *argv])
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_a_missing_engine_is_one_line_naming_it(capsys, tmp_path):
    assert main(["serve", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope" in err and err.startswith("dspark-compile serve: error:")


def test_a_missing_extra_fails_before_the_engine_loads(capsys, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["serve", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err == ("dspark-compile serve: error: serve needs fastapi (the "
                                       "'serve' extra): pip install 'dspark-compile[serve]'\n")


def test_an_address_in_use_is_one_line_naming_the_flags():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"--host 127.0.0.1 --port {port}: cannot bind"):
            _bind("127.0.0.1", port)


@pytest.mark.parametrize("argv,flag", [
    (["--allowed-origins", "ftp://x.example"], "--allowed-origins"),
    (["--allowed-origins", "https://*.example"], "--allowed-origins"),
    (["--api-key", "has space"], "--api-key"),
    (["--api-key", ""], "--api-key"),
    (["--api-key-file", "/nonexistent/key"], "--api-key-file"),
])
def test_bad_api_key_or_origins_are_one_line_before_the_engine_loads(argv, flag, capsys,
                                                                     tmp_path):
    assert main(["serve", str(tmp_path / "nope"), *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "nope" not in err
