"""The engine's kernel store (dspark_compile/engine_dir/kernel_store.py): kernels compiled into a store are
found by Triton's own lookup in a process whose Triton cache is empty, so nothing compiles;
a store for another SM or Triton is named in one line, and refused when required.

The round trip compiles a real kernel of this package for sm_90 (Triton cross-compiles without
a GPU) through Triton's cache manager, in a fresh process: this one runs kernels in Triton's
interpreter, which patches triton.language while it runs (kernels/sm12x.py, compile_entry).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dspark_compile.build import kernel_compile
from dspark_compile.engine_dir import kernel_store
from dspark_compile.engine_dir.format import ArtifactError

_ROUND_TRIP = r"""
import json, sys
from pathlib import Path
from triton import knobs
from dspark_compile.build import kernel_compile
from dspark_compile.engine_dir import kernel_store as ks
from dspark_compile.kernels import sm12x
from dspark_compile.kernels.registry import KERNELS
sm12x.import_all_kernel_modules()
entry = KERNELS["act_quant"].compile_configs[0]
tmp = Path(sys.argv[1])
knobs.cache.dir = str(tmp / "cache_a")
with kernel_compile.record() as seen:
    first = sm12x.compile_entry(entry, 90)
after_build = ks.compiles()
files, meta = kernel_compile.collect(seen, {"sm": "90", "triton": "x", "cuda": ""})
engine = tmp / "engine"
for rel, data in files.items():
    p = engine / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
knobs.cache.dir = str(tmp / "cache_b")          # a fresh machine: nothing cached
ks.use_store(engine / meta["path"])
hits = ks.store_hits()
again = sm12x.compile_entry(entry, 90)
print(json.dumps({"compiled_at_build": after_build, "compiled_at_load": ks.compiles() - after_build,
                  "store_hits": ks.store_hits() - hits, "meta": meta,
                  "same_binary": again.asm["cubin"] == first.asm["cubin"],
                  "cache_b_groups": [p.name for p in (tmp / "cache_b").rglob("__grp__*")]}))
"""


def test_a_stored_kernel_is_found_with_an_empty_triton_cache(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _ROUND_TRIP, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["compiled_at_build"] == 1
    assert out["compiled_at_load"] == 0, out
    assert out["store_hits"] >= 1
    assert out["same_binary"]
    assert out["cache_b_groups"] == []          # nothing written to the fresh cache
    meta = out["meta"]
    assert meta["kernels"] == 1 and meta["entries"] == 1 and meta["bytes"] > 1000
    assert meta["path"] == "kernels/triton/sm90-tritonx"
    # group files name their members relative to the entry, never the build machine's paths
    grp = next((tmp_path / "engine" / meta["path"]).rglob("__grp__*"))
    assert all("/" not in n for n in json.loads(grp.read_text())["child_paths"].values())


def _manifest(sm="90", triton="3.6.0"):
    return {"kernel_store": {"path": f"kernels/triton/sm{sm}-triton{triton}", "sm": sm,
                             "triton": triton, "cuda": "13.0", "entries": 3, "kernels": 3,
                             "bytes": 1}}


def test_check_names_what_does_not_match():
    here = {"sm": "120", "triton": "3.7.1", "cuda": "13.0"}
    why = kernel_store.check(_manifest(), here)
    assert "sm 90 (this machine: 120)" in why and "triton 3.6.0 (this machine: 3.7.1)" in why
    assert "\n" not in why
    assert kernel_store.check(_manifest("120", "3.7.1"), here) is None
    assert "carries no compiled kernels" in kernel_store.check({}, here)


def test_install_refuses_a_mismatch_only_when_required(tmp_path, monkeypatch):
    import torch
    monkeypatch.setattr(kernel_store, "toolchain",
                        lambda device: {"sm": "120", "triton": "3.7.1", "cuda": "13.0"})
    cuda = torch.device("cuda", 0)
    with pytest.raises(ArtifactError, match="sm 90 .this machine: 120.") as e:
        kernel_store.install(tmp_path, _manifest(), cuda, policy="require")
    assert e.value.field == "kernel_store"
    with pytest.warns(UserWarning, match="compiles the kernels at first use"):
        assert kernel_store.install(tmp_path, _manifest(), cuda) is False
    # matching toolchain, but the store's folder is gone: named, not a lookup of nothing
    with pytest.raises(ArtifactError, match="kernel store .* is missing"):
        kernel_store.install(tmp_path, _manifest("120", "3.7.1"), cuda, policy="require")
    assert kernel_store.install(tmp_path, _manifest(), cuda, policy="ignore") is False
    assert kernel_store.install(tmp_path, _manifest(), torch.device("cpu")) is False
    with pytest.raises(ValueError, match="policy must be one of"):
        kernel_store.install(tmp_path, _manifest(), cuda, policy="sometimes")


# ------------------------------------------------------------------ host code is never stored
KEY = "W2ZGDJ3N4MUWXMHXZGGIHRFR5J5KBCSUUKAYGTBC3FCHQAQWWNCA"
LAUNCHER = "cuda_utils.cpython-312-x86_64-linux-gnu.so"


def test_collect_stores_cubins_and_metadata_only(tmp_path):
    """The build stores what a cache hit reads that is not host code: a launcher module
    (Triton's cuda_utils .so) and the IRs are left out."""
    src = {}
    for name in ("k.cubin", "k.json", "k.ptx", "k.ttir", LAUNCHER):
        (tmp_path / name).write_bytes(b"x" * 8)
        src[name] = str(tmp_path / name)
    files, meta = kernel_compile.collect({KEY: {**src, "__grp__k.json": None}},
                                        {"sm": "90", "triton": "x", "cuda": ""})
    root = f"kernels/triton/sm90-tritonx/{KEY}"
    assert sorted(files) == [f"{root}/__grp__k.json", f"{root}/k.cubin", f"{root}/k.json"]
    assert json.loads(files[f"{root}/__grp__k.json"])["child_paths"] == {
        "k.cubin": "k.cubin", "k.json": "k.json"}


@pytest.fixture
def isolated_store(monkeypatch, tmp_path):
    """kernel_store's process state and Triton's cache manager and directory, restored after
    the test (this process's other tests run kernels in Triton's interpreter)."""
    from triton import knobs
    monkeypatch.setattr(knobs.cache, "manager_class", knobs.cache.manager_class)
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path / "triton_cache"))
    monkeypatch.setattr(kernel_store, "_PROC", kernel_store._Process())
    root = tmp_path / "store"
    (root / KEY).mkdir(parents=True)
    for name in ("k.cubin", "unlisted.cubin"):
        (root / KEY / name).write_bytes(b"\0" * 16)
    (root / KEY / "k.json").write_text('{"name": "k", "tensordesc_meta": []}')
    (root / KEY / "__grp__k.json").write_text(json.dumps(
        {"child_paths": {"k.cubin": "k.cubin", "k.json": "k.json"}}))
    return root


def test_the_store_answers_only_listed_cubins_and_metadata(isolated_store, tmp_path):
    root = isolated_store
    listed = {f"{KEY}/{n}" for n in ("k.cubin", "k.json", "__grp__k.json")}
    kernel_store.use_store(root, listed)
    cm = kernel_store.StoreCacheManager(KEY)
    assert cm.get_file("k.cubin") == str(root / KEY / "k.cubin")
    assert cm.get_file("unlisted.cubin") is None            # on disk, not in the file table
    assert cm.get_group("k.json") == {"k.cubin": str(root / KEY / "k.cubin"),
                                      "k.json": str(root / KEY / "k.json")}
    # a launcher module is never taken from a store, listed or not: the fallback cache answers
    assert cm.get_file(LAUNCHER) is None
    # a group naming a member by another path (outside its entry) is not a hit
    (root / KEY / "__grp__k.json").write_text(json.dumps(
        {"child_paths": {"k.cubin": "../../elsewhere/k.cubin", "k.json": "k.json"}}))
    assert cm.get_group("k.json") is None
    assert all(n.endswith((".cubin", ".json")) for n in kernel_store.store_files())


def test_a_store_holding_a_launcher_module_is_refused(isolated_store):
    (isolated_store / KEY / LAUNCHER).write_bytes(b"\x7fELF")
    with pytest.raises(ArtifactError, match=f"{LAUNCHER}' is not a cubin or metadata JSON"):
        kernel_store.use_store(isolated_store)
    assert not kernel_store._PROC.stores


def test_a_kernel_metadata_with_tensor_descriptors_is_refused(isolated_store):
    """Triton versions that write a launcher's C source per signature put a tensor
    descriptor's metadata fields into it; no kernel of ours takes a descriptor."""
    (isolated_store / KEY / "k.json").write_text(
        '{"name": "k", "tensordesc_meta": [{"swizzle": "0); system(\\"x\\"); (0"}]}')
    with pytest.raises(ArtifactError, match="'.*k.json' is not a kernel's metadata without"):
        kernel_store.use_store(isolated_store)


def test_a_store_holding_a_link_is_refused(isolated_store, tmp_path):
    (tmp_path / "elsewhere.cubin").write_bytes(b"\0")
    (isolated_store / KEY / "linked.cubin").symlink_to(tmp_path / "elsewhere.cubin")
    with pytest.raises(ArtifactError, match="linked.cubin' is a symbolic link"):
        kernel_store.use_store(isolated_store)
