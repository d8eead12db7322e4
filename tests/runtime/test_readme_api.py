"""The README's "Python API" example runs as written on a loaded engine (the session's small
CPU engine in place of `Engine.load("engine")`), and its events agree with generate()."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _api_example() -> str:
    text = README.read_text()
    section = text[text.index("\n## Python API"):]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_readme_python_api_example_runs(small_loaded, capsys):
    code = _api_example()
    load = 'eng = Engine.load("engine")'
    assert load in code
    ns = {"_loaded": small_loaded}
    exec(compile(code.replace(load, "eng = _loaded"), "README.md (Python API)", "exec"), ns)
    assert len(ns["res"].tokens[0]) == 32
    printed = [line.split(" ", 1) for line in capsys.readouterr().out.splitlines()]
    assert {int(r) for r, _ in printed} == {0, 1}       # events of both streamed requests
    assert ns["stream"].closed and ns["stream"].counters()["free_rows"] == \
        small_loaded.cache.max_rows
