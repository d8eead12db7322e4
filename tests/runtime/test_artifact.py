"""Engine artifact: atomic build, manifest validation (each mismatch named), corrupted and
truncated files named, round trip loaded in a fresh process."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import dspark_compile.kernels.moe  # noqa: F401  (the toy calls dspark::moe_experts)
from dspark_compile.engine_dir import format as artifact
from dspark_compile.engine_dir import write as writer
from dspark_compile.engine_dir.format import ArtifactError
from dspark_compile.engine_dir.load import load_engine, load_manifest
from dspark_compile.engine_dir.write import save_engine, update_manifest_field
from dspark_compile.models.linear import E8M0_STORAGE
from dspark_compile.passes import PassManager
from dspark_compile.engine_dir.versions import environment_fields

D, E, I, S = 64, 2, 32, 16
BUCKETS = (1, 4)


class Step(torch.nn.Module):
    """Weights as the real step has them (parameters, persistent and non-persistent buffers,
    MXFP4 experts with E8M0 scales), a cache input updated in place, a dspark:: op, and a
    literal constant export lifts into the program. `scale_dtype`: the scales' dtype,
    float8_e8m0fnu or the uint8 bytes the models hold (models/linear.py, E8M0_STORAGE)."""

    def __init__(self, seed=0, scale_dtype=torch.float8_e8m0fnu):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = torch.nn.Linear(D, D)
        self.router = torch.nn.Linear(D, E)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        self.register_buffer("norm", torch.randn(D, generator=g).to(torch.bfloat16))
        self.register_buffer("rope", torch.randn(D, generator=g), persistent=False)
        pk = lambda *s: torch.randint(-128, 128, s, generator=g, dtype=torch.int8)  # noqa: E731
        e8 = lambda *s: torch.randint(121, 127, s, generator=g,  # noqa: E731
                                      dtype=torch.uint8).view(scale_dtype)
        self.register_buffer("w1", pk(E, I, D // 2))
        self.register_buffer("s1", e8(E, I, D // 32))
        self.register_buffer("w3", pk(E, I, D // 2))
        self.register_buffer("s3", e8(E, I, D // 32))
        self.register_buffer("w2", pk(E, D, I // 2))
        self.register_buffer("s2", e8(E, D, I // 32))

    def forward(self, x, slots, kv_cache):
        h = self.proj(x) * self.norm.float() + self.rope
        kv_cache.index_copy_(0, slots, h)
        w, ids = self.router(h).softmax(-1).topk(1, dim=-1)
        y = torch.ops.dspark.moe_experts(h, ids, w, self.w1, self.s1, self.w3, self.s3,
                                         self.w2, self.s2, 7.0)
        return y * torch.tensor(2.0) + kv_cache.sum(0), ids


def make_inputs(seed, T):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, D, generator=g), torch.randperm(S, generator=g)[:T],
            torch.randn(S, D, generator=g))


def build_programs(model):
    programs, stats = {}, {}
    for T in BUCKETS:
        ep = torch.export.export(model, make_inputs(0, T))
        pm = PassManager()
        stats[T] = pm.run(ep, state_inputs=("kv_cache",))
        programs[T] = ep
    return programs, pm.manifest_entries(), stats


def fields(passes, stats, **extra):
    return {"model_config_hash": "cfg-0", "passes": passes, "pass_config_hash": "pc-0",
            "pass_stats": {str(b): [{k: r[k] for k in ("name", "time_ms", "nodes_before",
                                                       "nodes_after", "matches")}
                                    for r in rows] for b, rows in stats.items()},
            **extra}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One engine built for the module; tests work on copies of it."""
    root = tmp_path_factory.mktemp("built")
    model = Step().eval()
    programs, passes, stats = build_programs(model)
    manifest = save_engine(root / "engine", programs, manifest_fields=fields(passes, stats),
                           extra_files={"kernels/cpu/resources.txt": "moe_experts: reference"})
    return model, root / "engine", manifest, passes, stats


@pytest.fixture
def engine(built, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(built[1], dst)
    return dst


# ------------------------------------------------------------------ round trip
FRESH = textwrap.dedent("""
    import sys, torch
    from dspark_compile.engine_dir.load import load_engine
    assert not hasattr(torch.ops.dspark, "moe_experts"), "op registered before load_engine"
    device = sys.argv[3]
    manifest, programs, weights = load_engine(sys.argv[1], device=device)
    cases = torch.load(sys.argv[2])
    for b, (inputs, outputs) in cases.items():
        state = [t.to(device) for t in inputs]
        got = programs[b].module()(*state)
        for g, r in zip(got, outputs[:2]):
            torch.testing.assert_close(g.cpu(), r, rtol=0, atol=0)
        torch.testing.assert_close(state[2].cpu(), outputs[2], rtol=0, atol=0)  # cache updated
    m1, m4 = programs[1].module(), programs[4].module()
    assert m1.p_proj_weight is not None
    assert m1.p_proj_weight.data_ptr() == m4.p_proj_weight.data_ptr()
    assert str(weights["s1"].dtype) == sys.argv[4], weights["s1"].dtype   # the scales' dtype kept
    print("FRESH-OK", sorted(programs))
""")


def _expected(model, path, device="cpu"):
    cases = {}
    for b in BUCKETS:
        inputs = make_inputs(100 + b, b)
        state = [t.to(device) for t in inputs]
        with torch.no_grad():
            y, ids = model(*state)
        cases[b] = (inputs, (y.cpu(), ids.cpu(), state[2].cpu()))
    torch.save(cases, path)


def _load_fresh(engine_dir, tmp_path, device, scale_dtype=torch.float8_e8m0fnu):
    script = tmp_path / "load.py"
    script.write_text(FRESH)
    r = subprocess.run([sys.executable, str(script), str(engine_dir), str(tmp_path / "cases.pt"),
                        device, str(scale_dtype)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FRESH-OK [1, 4]" in r.stdout


def test_round_trip_in_a_fresh_process(built, tmp_path):
    model, engine_dir, *_ = built
    _expected(model, tmp_path / "cases.pt")
    _load_fresh(engine_dir, tmp_path, "cpu")


@pytest.mark.gpu
def test_cuda_engine_round_trip_in_a_fresh_process(tmp_path):
    # Built and loaded on the GPU: the manifest records this SM, weights load onto the device,
    # and the loaded programs reproduce the eager CUDA module bit for bit.
    # torch 2.11 (the GPU machine's) cannot serialize float8_e8m0fnu tensors at all, which is why
    # the models hold E8M0 scales as uint8 bytes; this engine does the same
    model = Step(scale_dtype=E8M0_STORAGE).eval().cuda()
    programs = {}
    for T in BUCKETS:
        ep = torch.export.export(model, tuple(t.cuda() for t in make_inputs(0, T)))
        pm = PassManager()
        pm.run(ep, state_inputs=("kv_cache",))
        programs[T] = ep
    m = save_engine(tmp_path / "engine", programs,
                    manifest_fields={"model_config_hash": "cfg", "passes": pm.manifest_entries()})
    major, minor = torch.cuda.get_device_capability()
    assert m["target_sm"] == f"sm_{major}{minor}" and m["cuda_version"] == torch.version.cuda
    _expected(model, tmp_path / "cases.pt", "cuda")
    _load_fresh(tmp_path / "engine", tmp_path, "cuda", E8M0_STORAGE)


def test_reading_a_program_needs_the_ops_registered(built, tmp_path):
    # Why load_engine registers ops first: a fresh process resolves no dspark:: op by name
    # until the kernels are imported; the reader refuses the program naming it.
    code = ("import sys; from dspark_compile.engine_dir.graph_read import read_program; "
            "read_program(open(sys.argv[1], 'rb').read(), rel='p')")
    r = subprocess.run([sys.executable, "-c", code, str(built[1] / "programs/step_b1.json")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode != 0 and "moe_experts" in r.stderr and "ArtifactError" in r.stderr


def test_load_in_process_shares_weights_and_matches_eager(built):
    model, engine_dir, *_ = built
    manifest, programs, weights = load_engine(engine_dir)
    for b in BUCKETS:
        a, c = make_inputs(7, b), make_inputs(7, b)
        got = programs[b].module()(*a)
        with torch.no_grad():
            ref = model(*c)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        torch.testing.assert_close(a[2], c[2], rtol=0, atol=0)
        m = programs[b].module()
        assert m.p_proj_weight.data_ptr() == weights["proj.weight"].data_ptr()
        assert m.b_rope is weights["rope"]
        assert isinstance(m.p_proj_weight, torch.nn.Parameter)


def test_weights_are_stored_once_not_in_the_programs(built, tmp_path):
    model, engine_dir, manifest, *_ = built
    sizes = {k: v["size"] for k, v in manifest["files"].items()}
    weights = {**model.state_dict(), "rope": model.rope}
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert sizes["weights.safetensors"] > weight_bytes
    ep = torch.export.export(model, make_inputs(0, 4))
    torch.export.save(ep, str(tmp_path / "with_weights.pt2"))
    embedded = os.path.getsize(tmp_path / "with_weights.pt2")
    for b in BUCKETS:
        assert manifest["programs"][str(b)]["shared_weights"] == sorted(weights)
        # a plain save embeds every weight; the engine's programs carry none of them
        assert embedded - sizes[f"programs/step_b{b}.json"] >= weight_bytes


def test_loaded_weights_are_aligned(built):
    # safetensors puts tensors at arbitrary offsets; misaligned weights make BLAS/Triton take
    # other, differently rounded paths (the engine would not match the build bit for bit).
    _, _, weights = load_engine(built[1])
    assert all(t.data_ptr() % 64 == 0 for t in weights.values())


# ------------------------------------------------------------------ manifest
def test_manifest_records_everything(built):
    _, engine_dir, manifest, passes, _ = built
    env = environment_fields()
    assert manifest["format_version"] == artifact.FORMAT_VERSION
    for k in ("dspark_compile_version", "torch_version", "triton_version", "cuda_version",
              "target_sm"):
        assert manifest[k] == env[k]
    assert manifest["target_sm"] == ("cpu" if not torch.cuda.is_available() else env["target_sm"])
    assert manifest["model_config_hash"] == "cfg-0"
    assert manifest["buckets"] == [1, 4]
    assert manifest["passes"] == passes and all(len(p["source_hash"]) == 64 for p in passes)
    assert [r["name"] for r in manifest["pass_stats"]["4"]] == [p["name"] for p in passes]
    assert manifest["graph_memory_bytes"] == {"1": None, "4": None}
    assert "dspark::moe_experts.default" in manifest["dspark_ops"]
    t = manifest["weights"]["tensors"]
    assert t["proj.weight"]["shape"] == [D, D] and len(t["proj.weight"]["sha256"]) == 64
    assert t["s1"]["dtype"] == "float8_e8m0fnu" and t["s1"]["stored_as"] == "uint8"
    assert t["norm"]["dtype"] == "bfloat16"
    # the model's `torch.tensor(2.0)` literal is each program's own constant, beside it
    assert set(manifest["files"]) == {"programs/step_b1.json", "programs/step_b4.json",
                                      "programs/step_b1.constants.safetensors",
                                      "programs/step_b4.constants.safetensors",
                                      "weights.safetensors", "kernels/cpu/resources.txt"}
    for rel, info in manifest["files"].items():
        assert info["size"] == os.path.getsize(engine_dir / rel) and len(info["sha256"]) == 64
    on_disk = json.loads((engine_dir / "manifest.json").read_text())
    assert on_disk == manifest


def test_update_manifest_field_is_atomic_and_keeps_it_valid(engine):
    update_manifest_field(engine, "graph_memory_bytes.4", 123456)
    m = load_manifest(engine)
    assert m["graph_memory_bytes"] == {"1": None, "4": 123456}
    assert sorted(os.listdir(engine)) == ["kernels", "manifest.json", "programs",
                                          "weights.safetensors"]
    with pytest.raises(ArtifactError, match="maintained by the build"):
        update_manifest_field(engine, "checksum", "x")


ENV_CASES = {
    "torch_version": "2.11.0",
    "triton_version": "3.6.0",
    "cuda_version": "12.8",
    "dspark_compile_version": "0.0.1",
    "target_sm": "sm_120",
}


@pytest.mark.parametrize("version", [1, 999])
def test_other_format_version_refused_in_one_line_naming_the_rebuild(engine, version):
    """An engine of the old format (1: torch.export archives) or of a later one is refused
    before any program is read, in one line that names the engine and the build command that
    replaces it, with the engine's own buckets."""
    update_manifest_field(engine, "format_version", version)
    update_manifest_field(engine, "build_config", {"buckets": [1, 4], "max_seq_len": 64})
    for load in (load_manifest, load_engine):
        with pytest.raises(ArtifactError) as e:
            load(engine)
        msg = str(e.value)
        assert e.value.field == "format_version" and "\n" not in msg
        assert msg.startswith(f"engine {engine} has format_version {version} (")
        assert msg.endswith(f"— rebuild it: dspark-compile build CHECKPOINT --out {engine} "
                            "--buckets 1,4 --max-seq-len 64 --overwrite")
        assert ("torch.export archives" in msg) == (version == 1)


@pytest.mark.parametrize("field", sorted(ENV_CASES))
def test_environment_mismatch_names_the_field(engine, field):
    update_manifest_field(engine, field, ENV_CASES[field])
    running = environment_fields().get(field, artifact.FORMAT_VERSION)
    with pytest.raises(ArtifactError) as e:
        load_manifest(engine)
    assert e.value.field == field
    assert str(e.value) == (f"manifest field '{field}': engine built with {ENV_CASES[field]}, "
                            f"running {running} — rebuild")
    with pytest.raises(ArtifactError, match=f"manifest field '{field}'"):
        load_engine(engine)


def test_target_sm_follows_the_programs_device(engine, monkeypatch):
    """A CPU engine records "cpu" and loads on a machine with a GPU; a GPU engine must match the
    GPU it loads onto, and cannot load onto the CPU (faked: a machine with an sm_90 GPU)."""
    assert load_manifest(engine)["target_sm"] == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    load_manifest(engine)                                  # CPU engine, GPU machine: fine
    load_manifest(engine, device="cpu")
    update_manifest_field(engine, "target_sm", "sm_90")
    load_manifest(engine)                                  # this machine's GPU
    load_manifest(engine, device="cuda:0")
    with pytest.raises(ArtifactError, match="manifest field 'target_sm': engine built with "
                                            "sm_90, running cpu"):
        load_manifest(engine, device="cpu")
    update_manifest_field(engine, "target_sm", "sm_120")
    with pytest.raises(ArtifactError, match="built with sm_120, running sm_90"):
        load_manifest(engine)


def test_skip_and_expect_override_environment_checks(engine):
    update_manifest_field(engine, "target_sm", "sm_90")
    load_manifest(engine, expect={"target_sm": "sm_90"})
    load_manifest(engine, skip=("target_sm",))


@pytest.mark.parametrize("field, want", [("model_config_hash", "cfg-other"),
                                         ("buckets", [1, 2, 4]),
                                         ("pass_config_hash", "pc-1")])
def test_expectation_mismatch_names_the_field(engine, field, want):
    with pytest.raises(ArtifactError, match=rf"manifest field '{field}': engine has .*, "
                                            rf"expected .* — rebuild") as e:
        load_manifest(engine, expect={field: want})
    assert e.value.field == field


def test_expected_field_missing(engine):
    with pytest.raises(ArtifactError, match="manifest field 'model_name' is missing"):
        load_manifest(engine, expect={"model_name": "flash"})


def test_changed_pass_source_is_named(engine, built):
    passes = [dict(p) for p in built[3]]
    passes[2]["source_hash"] = "0" * 64
    update_manifest_field(engine, "passes", passes)
    with pytest.raises(ArtifactError, match=rf"pass '{passes[2]['name']}' source hash 000000000000 "
                                            r"in the engine, \w{12} installed"):
        load_manifest(engine)
    passes[2] = {"name": "fuse_gone", "source_hash": "1" * 64}
    update_manifest_field(engine, "passes", passes)
    with pytest.raises(ArtifactError, match="pass 'fuse_gone', which is not installed"):
        load_manifest(engine)


def test_changed_op_schema_is_named(engine):
    update_manifest_field(engine, "dspark_ops", {
        "dspark::moe_experts.default": "dspark::moe_experts(Tensor x) -> Tensor"})
    with pytest.raises(ArtifactError, match="op dspark::moe_experts.default schema changed"):
        load_manifest(engine)
    update_manifest_field(engine, "dspark_ops", {"dspark::nope.default": "dspark::nope() -> ()"})
    with pytest.raises(ArtifactError, match="op dspark::nope.default is not registered"):
        load_manifest(engine)


def test_hand_edited_or_broken_manifest(engine, tmp_path):
    m = json.loads((engine / "manifest.json").read_text())
    m["torch_version"] = "2.13.0"           # edited without the checksum
    (engine / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"manifest.json is corrupted \(checksum mismatch\)"):
        load_manifest(engine)
    (engine / "manifest.json").write_text('{"format_version": 1, ')
    with pytest.raises(ArtifactError, match=r"manifest.json is corrupted \(not valid JSON"):
        load_manifest(engine)
    (engine / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="is not an engine: manifest.json is missing"):
        load_manifest(engine)
    with pytest.raises(ArtifactError, match="does not exist"):
        load_manifest(tmp_path / "nowhere")


# ------------------------------------------------------------------ damaged files
def test_corrupted_file_is_named(engine):
    p = engine / "weights.safetensors"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"engine file 'weights.safetensors' is corrupted: "
                                            r"sha256") as e:
        load_engine(engine)
    assert e.value.path == "weights.safetensors"


def test_truncated_file_is_named(engine):
    p = engine / "programs" / "step_b4.json"
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ArtifactError, match=rf"engine file 'programs/step_b4.json' is truncated: "
                                            rf"{size - 100} of {size} bytes"):
        load_engine(engine)


def test_missing_and_grown_files_are_named(engine):
    report = engine / "kernels" / "cpu" / "resources.txt"
    original = report.read_bytes()
    report.write_bytes(original + b"x")
    with pytest.raises(ArtifactError, match="'kernels/cpu/resources.txt' has the wrong size"):
        load_manifest(engine)
    report.write_bytes(original)
    load_manifest(engine)
    (engine / "programs" / "step_b1.json").unlink()
    with pytest.raises(ArtifactError, match="engine file 'programs/step_b1.json' is missing"):
        load_manifest(engine)


# ------------------------------------------------------------------ atomic build
def _leftovers(parent):
    return [n for n in os.listdir(parent) if n.startswith(".")]


def test_failed_build_keeps_the_previous_engine(built, engine, monkeypatch):
    model, _, _, passes, stats = built
    before = (engine / "manifest.json").read_bytes()
    programs, _, _ = build_programs(model)

    # 1) fails while validating: the programs use weights the caller did not pass
    with pytest.raises(ArtifactError, match="uses weight '.*', which is not in `weights`"):
        save_engine(engine, programs, weights={"proj.weight": model.proj.weight},
                    manifest_fields=fields(passes, stats))
    # 2) fails half-way through writing the second program
    from dspark_compile.engine_dir import write
    real_dump, calls = write.dump_program, []

    def failing_dump(ep, *a, **kw):
        calls.append(ep)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_dump(ep, *a, **kw)

    monkeypatch.setattr(write, "dump_program", failing_dump)
    with pytest.raises(OSError, match="disk full"):
        save_engine(engine, programs, manifest_fields=fields(passes, stats, model_config_hash="v2"))
    monkeypatch.undo()
    assert len(calls) == 2
    assert (engine / "manifest.json").read_bytes() == before
    assert _leftovers(engine.parent) == []
    assert load_manifest(engine)["model_config_hash"] == "cfg-0"


def test_rebuild_replaces_the_engine_when_complete(built, engine):
    model, _, _, passes, stats = built
    programs, _, _ = build_programs(model)
    m = save_engine(engine, {1: programs[1]}, manifest_fields=fields(passes, stats,
                                                                     model_config_hash="v2"))
    assert load_manifest(engine, expect={"model_config_hash": "v2", "buckets": [1]}) == m
    assert not (engine / "programs" / "step_b4.json").exists()
    assert not (engine / "kernels").exists()
    assert _leftovers(engine.parent) == []


def test_refuses_to_replace_a_directory_that_is_not_an_engine(built, tmp_path):
    model, _, _, passes, stats = built
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    programs, _, _ = build_programs(model)
    with pytest.raises(ArtifactError, match="refusing to replace"):
        save_engine(other, programs, manifest_fields=fields(passes, stats))
    assert (other / "keep.txt").read_text() == "mine"
    assert _leftovers(tmp_path) == []


def test_save_engine_rejects_bad_arguments(built, tmp_path):
    model, _, _, passes, stats = built
    ep = build_programs(model)[0][1]
    ok = fields(passes, stats)
    cases = [
        (dict(programs={}), "at least one program"),
        (dict(programs={0: ep}), "bucket keys must be positive ints"),
        (dict(programs={1: "x"}), "not an ExportedProgram"),
        (dict(manifest_fields={"passes": passes}), r"missing \['model_config_hash'\]"),
        (dict(manifest_fields={**ok, "torch_version": "x"}), "may not set computed fields"),
        (dict(extra_files={"../evil": b""}), "must live under one of"),
    ]
    for kw, msg in cases:
        args = dict(programs={1: ep}, manifest_fields=ok)
        args.update(kw)
        with pytest.raises(ArtifactError, match=msg):
            save_engine(tmp_path / "e", **args)
    assert not (tmp_path / "e").exists() and _leftovers(tmp_path) == []


def test_programs_with_different_weights_are_refused(built, tmp_path):
    _, _, _, passes, stats = built
    a = torch.export.export(Step(seed=0).eval(), make_inputs(0, 1))
    b = torch.export.export(Step(seed=1).eval(), make_inputs(0, 4))
    with pytest.raises(ArtifactError, match="weight '.*' of the program for bucket 4 differs"):
        save_engine(tmp_path / "e", {1: a, 4: b}, manifest_fields=fields(passes, stats))


def test_model_config_is_hashed(built, tmp_path):
    model, _, _, passes, stats = built
    ep = build_programs(model)[0][1]
    f = fields(passes, stats)
    del f["model_config_hash"]
    m = save_engine(tmp_path / "e", {1: ep}, manifest_fields={**f, "model_config": {"a": 1}})
    assert m["model_config_hash"] == artifact.config_hash({"a": 1})
    assert m["model_config"] == {"a": 1}


# ------------------------------------------------------------------ misuse and killed builds
def test_manifest_without_checksum_is_corrupted(engine):
    m = json.loads((engine / "manifest.json").read_text())
    del m["checksum"]
    (engine / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"manifest.json is corrupted \(no 'checksum' field\)"):
        load_manifest(engine)


def _rewrite_manifest(engine, edit):
    m = json.loads((engine / "manifest.json").read_text())
    edit(m)
    m["checksum"] = artifact._checksum(m)
    (engine / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("field", ["model_config", "build_config"])
def test_run_names_a_missing_engine_field(engine, capsys, field):
    """A consistent manifest without the fields the runtime needs: one line, no KeyError."""
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.cli.main import main
    from dspark_compile.factory.presets import preset

    def edit(m):
        m["model_config"] = preset("tiny")
        m["build_config"] = BuildConfig(buckets=BUCKETS).to_manifest()
        del m[field]
    _rewrite_manifest(engine, edit)
    assert main(["run", str(engine), "--prompt-ids", "1,2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"dspark-compile run: error: manifest field '{field}' is missing (not an "
                   "engine that `dspark-compile build` wrote) — rebuild")


def test_engine_fields_name_a_missing_or_unknown_build_option(engine):
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.engine_dir.fields import engine_configs
    from dspark_compile.factory.presets import preset
    m = {"model_config": preset("tiny"), "build_config": BuildConfig(buckets=BUCKETS).to_manifest()}
    cfg, bc = engine_configs(m)
    assert (cfg.dspark_block_size, bc.buckets) == (5, BUCKETS)
    del m["build_config"]["max_seq_len"]
    with pytest.raises(ArtifactError, match=r"'build_config' lacks \['max_seq_len'\]") as e:
        engine_configs(m)
    assert e.value.field == "build_config.max_seq_len"
    m["build_config"].update(max_seq_len=64, nosuch=1)
    with pytest.raises(ArtifactError, match=r"'build_config' has unknown \['nosuch'\]"):
        engine_configs(m)
    m["model_config"] = {**preset("tiny"), "hidden_size": "big"}
    with pytest.raises(ArtifactError, match="manifest field 'model_config': config field 'hidden_size'"):
        engine_configs(m)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_next_build_removes_temporaries_of_dead_builds_only(built, tmp_path):
    """SIGKILL skips every cleanup: the next build of the same output removes what the killed
    one left; a temporary of a live process (a concurrent build) stays."""
    from dspark_compile.atomic_dir import temp_dir
    model, _, _, passes, stats = built
    out = tmp_path / "engine"
    killed = []
    for kind in ("tmp", "old"):
        t = temp_dir(out, kind)
        (t / "weights.safetensors").write_bytes(b"\0" * 1024)
        killed.append(t.rename(t.with_name(t.name.replace(f"-{os.getpid()}-",
                                                            f"-{_dead_pid()}-"))))
    live = temp_dir(out)   # this process is alive: stands for a concurrent build
    other = tmp_path / ".other.tmp-1-abc"   # another destination's: not ours to judge
    other.mkdir()
    programs, _, _ = build_programs(model)
    save_engine(out, programs, manifest_fields=fields(passes, stats))
    assert not any(p.exists() for p in killed)
    assert live.is_dir() and other.is_dir()
    load_manifest(out)


def test_a_build_killed_while_swapping_gives_the_previous_engine_back(engine, tmp_path):
    """SIGKILL between parking the previous engine and renaming the new one into place leaves no
    engine at the destination: the next write's cleanup puts the parked one back, not away."""
    from dspark_compile.atomic_dir import PARKED, remove_stale_temps, temp_dir
    before = load_manifest(engine)
    parked = temp_dir(engine, "old")
    os.rename(engine, parked / PARKED)
    finished = temp_dir(engine)                     # the killed build's complete engine
    (finished / "weights.safetensors").write_bytes(b"\0" * 1024)
    dead = _dead_pid()
    for t in (parked, finished):
        t.rename(t.with_name(t.name.replace(f"-{os.getpid()}-", f"-{dead}-")))
    assert not engine.exists()
    assert len(remove_stale_temps(engine)) == 2
    assert load_manifest(engine) == before
    assert sorted(os.listdir(tmp_path)) == [engine.name]


def test_sigterm_during_a_build_removes_its_temporary(built, tmp_path, monkeypatch):
    import signal
    import time

    from dspark_compile.cli.common import Terminated, sigterm_raises
    model, _, _, passes, stats = built
    programs, _, _ = build_programs(model)

    def killed(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    monkeypatch.setattr(writer, "_save_weights", killed)
    with sigterm_raises(), pytest.raises(Terminated):
        save_engine(tmp_path / "engine", programs, manifest_fields=fields(passes, stats))
    assert sorted(os.listdir(tmp_path)) == []


# ------------------------------------------------------------------ one program, every bucket
def test_a_dynamic_program_is_stored_once_and_serves_every_bucket(tmp_path):
    """A program exported with a dynamic size (build --dynamic-batch) is written once at its
    kind's shared path, every bucket's entry names it, the load reads it once (one
    GraphProgram), and at each bucket it equals the eager model bit for bit; a call outside
    its size range is refused naming the range."""
    model = Step().eval()
    T = torch.export.Dim("T", min=1, max=S)
    with torch.no_grad():
        ep = torch.export.export(model, make_inputs(0, 4),
                                 dynamic_shapes=({0: T}, {0: T}, None))
    pm = PassManager()
    stats = pm.run(ep, state_inputs=("kv_cache",))
    m = save_engine(tmp_path / "engine", {1: ep, 4: ep},
                    manifest_fields=fields(pm.manifest_entries(), {1: stats, 4: stats}))
    assert {e["path"] for e in m["programs"].values()} == {"programs/step.json"}
    assert [f for f in m["files"] if f.startswith("programs/")] == [
        "programs/step.constants.safetensors", "programs/step.json"]
    _, programs, weights = load_engine(tmp_path / "engine")
    assert programs[1] is programs[4] and list(programs[1].sizes.values()) == [(1, S)]
    fn = programs[1].module()
    for b in (1, 3, 4):
        a, c = make_inputs(11, b), make_inputs(11, b)
        got = fn(*a)
        with torch.no_grad():
            ref = model(*c)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        torch.testing.assert_close(a[2], c[2], rtol=0, atol=0)
    x, slots, cache = make_inputs(0, 2)
    with pytest.raises(ValueError, match=rf"input 'slots' must be torch.int64 \['(\w+)'\] "
                                         rf"\(\1 in \[1, {S}\]\), got torch.int64 \[3\]"):
        fn(x, torch.arange(3), cache)     # T bound to 2 by x, 3 by slots
