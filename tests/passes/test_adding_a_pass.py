"""The worked example of README.md's "Adding a pass" section, executed from the markdown."""
import re
from pathlib import Path

import dspark_compile.passes as passes
from dspark_compile.passes import isolated_registry

DOC = Path(__file__).resolve().parents[2] / "README.md"


def code_blocks() -> dict:
    """{'passes/fuse_silu.py': source, 'tests/passes/test_fuse_silu.py': source}: the python
    blocks of the "Adding a pass" section (the README's other examples have tests of their own,
    e.g. tests/runtime/test_readme_api.py)."""
    text = DOC.read_text()
    section = text[text.index("\n## Adding a pass\n"):]
    nxt = re.search(r"\n## (?!#)", section[1:])
    section = section[:nxt.start() + 1] if nxt else section
    blocks = {}
    for body in re.findall(r"```python\n(.*?)```", section, flags=re.S):
        first = body.splitlines()[0]
        m = re.match(r"# file: (\S+)", first)
        assert m, f"every python block in {DOC.name} starts with '# file: <path>'"
        blocks[m.group(1)] = body
    return blocks


def test_doc_has_one_pass_file_and_its_test():
    blocks = code_blocks()
    assert set(blocks) == {"passes/fuse_silu.py", "tests/passes/test_fuse_silu.py"}
    assert blocks["passes/fuse_silu.py"].count("@register_pass(") == 1


def test_doc_example_pass_and_its_test_run():
    blocks = code_blocks()
    with isolated_registry() as reg:
        # executed as if it were the module dspark_compile.passes.fuse_silu
        pass_ns = {"__name__": "dspark_compile.passes.fuse_silu",
                   "__package__": "dspark_compile.passes"}
        exec(compile(blocks["passes/fuse_silu.py"], "passes/fuse_silu.py", "exec"), pass_ns)
        assert "fuse_silu" in reg and reg["fuse_silu"].expect_match
        test_ns = {"__name__": "doc_test_fuse_silu"}
        exec(compile(blocks["tests/passes/test_fuse_silu.py"], "test_fuse_silu.py", "exec"),
             test_ns)
        tests = [v for k, v in test_ns.items() if k.startswith("test_") and callable(v)]
        assert tests
        for t in tests:
            t()
    assert "fuse_silu" not in passes.REGISTRY  # the doc's pass does not leak into other tests
