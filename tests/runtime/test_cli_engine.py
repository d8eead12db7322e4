"""`dspark-compile build / run / inspect` on the tiny engine, in-process (cli.main).

The build itself is the `small_engine` session fixture (conftest.py): it runs
`dspark-compile build CKPT --out ENGINE --buckets 2,1 --max-rows 5 ...` and keeps its output,
which is checked here. Bad input exits non-zero with one line naming the problem."""
import shutil

import pytest

from dspark_compile.cli.main import main
from dspark_compile.models.generate import generate
from dspark_compile.models.request import SamplingParams
from dspark_compile.passes import PassManager


def _one_line_error(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"dspark-compile {command}: error: "), err
    return lines[0]


def test_build_prints_progress_per_stage_and_the_pass_table(small_engine):
    rc, out, err = small_engine.log
    assert rc == 0
    # the default: one program of dynamic batch for both buckets, exported at the largest
    for s in ("[load] checkpoint", "[load] done", "[export] bucket 2 (every bucket):",
              "[export] target bucket 2 (every bucket):", "[write]"):
        assert s in out, s
    assert "[export] bucket 1" not in out and "[export] target bucket 1" not in out
    names = PassManager().names
    for name in names:
        assert f"[pass] bucket 2 (every bucket): {name}" in out, name
    table = out[out.index("index  name"):].splitlines()
    assert table[0].split()[:4] == ["index", "name", "stage", "time_ms"]
    assert [row.split()[1] for row in table[2:2 + len(names)]] == names
    assert small_engine.manifest["buckets"] == [1, 2]
    assert small_engine.manifest["build_config"]["max_rows"] == 5
    # the CLI's default: a target-only program per bucket
    assert small_engine.manifest["build_config"]["target_programs"] is True
    assert sorted(small_engine.manifest["target_programs"]) == ["1", "2"]


def test_run_prints_tokens_acceptance_time_and_lossless(small_engine, ref_model, capsys):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    rc = main(["run", str(small_engine.path), "--prompt-ids", "3,1,4,1,5", "--prompt-ids", "9,2,6",
               "--max-new-tokens", "10", "--check-lossless", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "loaded " in out and " on cpu in " in out
    assert "acceptance per draft position:" in out and "mean accepted length:" in out
    assert "ms/step" in out and "tok/s" in out
    # speculative vs the engine's target-only decoding (bit-exact), then that vs the eager
    # reference (float64: equal too)
    assert out.strip().splitlines()[-2:] == ["lossless: ok", "reference: ok"]
    got = [[int(t) for t in line.split(": ")[1].split(",")]
           for line in out.splitlines() if line.startswith("tokens[")]
    params = [SamplingParams(max_new_tokens=10, seed=i) for i in range(2)]
    ref = generate(ref_model, prompts, params, speculative=True)
    assert got == ref.tokens


def test_run_no_speculation_decodes_through_the_target_programs(small_engine, ref_model, capsys):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [7, 7, 7, 1]]
    rc = main(["run", str(small_engine.path), *[a for p in prompts for a in
                                                ("--prompt-ids", ",".join(map(str, p)))],
               "--max-new-tokens", "9", "--no-speculation", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "acceptance" not in out and "mean accepted length" not in out
    got = [[int(t) for t in line.split(": ")[1].split(",")]
           for line in out.splitlines() if line.startswith("tokens[")]
    params = [SamplingParams(max_new_tokens=9, seed=i) for i in range(3)]
    assert got == generate(ref_model, prompts, params, speculative=False).tokens
    # 9 tokens each: the first from the prefill, then one per step (each step runs the three
    # rows as two program calls, buckets 2 and 1)
    steps = int(out.split("steps: ")[1].split()[0])
    assert steps == 8, out


def test_run_check_lossless_and_no_speculation_are_exclusive(small_engine, capsys):
    assert main(["run", str(small_engine.path), "--prompt-ids", "1,2", "--check-lossless",
                 "--no-speculation", "--device", "cpu"]) == 1
    assert "pass one of them" in _one_line_error(capsys.readouterr().err, "run")


def test_run_without_target_programs_names_the_build_flag(default_engine, capsys):
    """The default_engine fixture is built with BuildConfig's default: no target programs."""
    for flag in ("--no-speculation", "--check-lossless"):
        assert main(["run", str(default_engine.path), "--prompt-ids", "1,2", flag,
                     "--device", "cpu"]) == 1
        line = _one_line_error(capsys.readouterr().err, "run")
        assert "has no target-only programs (built with --no-target-programs)" in line, line
        assert flag in line


def test_inspect_prints_manifest_buckets_and_passes(small_engine, capsys):
    assert main(["inspect", str(small_engine.path)]) == 0
    out = capsys.readouterr().out
    for k in ("format_version", "torch_version", "triton_version", "target_sm",
              "model_config_hash", "build_config", "graph_memory_bytes"):
        assert f"{k}:" in out, k
    assert "buckets: [1, 2]" in out and '"max_rows": 5' in out
    assert "loads here: yes" in out
    assert "passes (bucket 2):" in out and "index  name" in out
    for name in PassManager().names:
        assert name in out
    assert main(["inspect", str(small_engine.path), "--json"]) == 0
    import json
    assert json.loads(capsys.readouterr().out)["buckets"] == [1, 2]


def test_inspect_names_a_stale_engine_but_still_shows_it(small_engine, tmp_path, capsys):
    from dspark_compile.engine_dir.write import update_manifest_field
    eng = tmp_path / "engine"
    shutil.copytree(small_engine.path, eng)
    passes = small_engine.manifest["passes"]
    update_manifest_field(eng, "passes", [{**passes[0], "source_hash": "0" * 64}] + passes[1:])
    assert main(["inspect", str(eng)]) == 0
    out = capsys.readouterr().out
    assert "buckets: [1, 2]" in out
    assert f"loads here: no: manifest field 'passes': pass '{passes[0]['name']}'" in out


# ------------------------------------------------------------------ bad input
def test_build_missing_checkpoint(tmp_path, capsys):
    assert main(["build", str(tmp_path / "nope"), "--out", str(tmp_path / "e")]) == 1
    line = _one_line_error(capsys.readouterr().err, "build")
    assert "checkpoint directory not found" in line and "nope" in line
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("buckets, why", [("1,x", "expected comma-separated bucket sizes"),
                                          ("0,2", "bucket sizes must be positive"),
                                          ("", "expected comma-separated bucket sizes")])
def test_build_bad_bucket_list(tiny_ckpt, tmp_path, capsys, buckets, why):
    with pytest.raises(SystemExit) as e:   # argparse: usage line + one error line, status 2
        main(["build", str(tiny_ckpt), "--out", str(tmp_path / "e"), "--buckets", buckets])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --buckets" in last and why in last


def test_build_refuses_to_replace_a_non_engine_directory(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["build", str(tiny_ckpt), "--out", str(out), "--buckets", "1"]) == 1
    assert "not an engine directory" in _one_line_error(capsys.readouterr().err, "build")
    assert (out / "notes.txt").read_text() == "keep me"


def test_run_on_a_directory_that_is_not_an_engine(tmp_path, capsys):
    (tmp_path / "x.txt").write_text("hi")
    assert main(["run", str(tmp_path), "--prompt-ids", "1,2", "--device", "cpu"]) == 1
    assert "is not an engine: manifest.json is missing" in _one_line_error(
        capsys.readouterr().err, "run")
    assert main(["run", str(tmp_path / "missing"), "--prompt-ids", "1", "--device", "cpu"]) == 1
    assert "does not exist" in _one_line_error(capsys.readouterr().err, "run")
    assert main(["inspect", str(tmp_path)]) == 1
    assert "is not an engine" in _one_line_error(capsys.readouterr().err, "inspect")


@pytest.mark.parametrize("damage", ["corrupted", "truncated"])
def test_run_on_a_damaged_program_file(small_engine, tmp_path, capsys, damage):
    eng = tmp_path / "engine"
    shutil.copytree(small_engine.path, eng)
    prog = eng / "programs" / "step.json"
    data = bytearray(prog.read_bytes())
    if damage == "corrupted":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[:len(data) // 3]
    prog.write_bytes(bytes(data))
    assert main(["run", str(eng), "--prompt-ids", "1,2", "--device", "cpu"]) == 1
    line = _one_line_error(capsys.readouterr().err, "run")
    assert f"engine file 'programs/step.json' is {damage}" in line
    assert main(["inspect", str(eng)]) == 1
    assert "programs/step.json" in _one_line_error(capsys.readouterr().err, "inspect")


def test_run_check_lossless_needs_greedy(small_engine, capsys):
    rc = main(["run", str(small_engine.path), "--prompt-ids", "1,2", "--temperature", "0.7",
               "--check-lossless", "--device", "cpu"])
    assert rc == 1
    assert "--check-lossless compares greedy decoding" in _one_line_error(
        capsys.readouterr().err, "run")


def test_run_checks_prompts_against_the_manifest_before_loading(small_engine, capsys):
    """The engine's max_seq_len (160) and vocabulary (512) decide these; nothing is loaded."""
    long = ",".join(["3"] * 150)
    assert main(["run", str(small_engine.path), "--prompt-ids", "1,2", "--prompt-ids", long,
                 "--max-new-tokens", "8", "--device", "cpu"]) == 1
    cap = capsys.readouterr()
    assert "loaded " not in cap.out
    line = _one_line_error(cap.err, "run")
    assert ("--prompt-ids (prompt 1): 150 tokens + --max-new-tokens 8 need 165 positions (with "
            "the draft block of 5 and its lookahead); the engine holds max_seq_len=160 "
            "(build --max-seq-len)") in line
    assert main(["run", str(small_engine.path), "--prompt-ids", "1,512", "--device", "cpu"]) == 1
    cap = capsys.readouterr()
    assert "loaded " not in cap.out
    assert "--prompt-ids (prompt 0): token ids [512] outside [0, 512)" in _one_line_error(
        cap.err, "run")


@pytest.mark.parametrize("field", ["model_config", "build_config"])
def test_engine_load_names_a_missing_manifest_field(small_engine, tmp_path, field):
    import json

    from dspark_compile.engine_dir.format import ArtifactError, _checksum
    from dspark_compile.runtime.engine import Engine
    eng = tmp_path / "engine"
    shutil.copytree(small_engine.path, eng)
    m = json.loads((eng / "manifest.json").read_text())
    del m[field]
    m["checksum"] = _checksum(m)
    (eng / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=f"manifest field '{field}' is missing") as e:
        Engine.load(eng, device="cpu")
    assert e.value.field == field


# ------------------------------------------------------------------ manifests edited by hand
def _edited(small_engine, tmp_path, field: str, value):
    """A copy of the small engine whose manifest field was edited and its checksum recomputed
    (what a user fixing a path would do)."""
    import json

    from dspark_compile.engine_dir.format import _checksum
    eng = tmp_path / "engine"
    shutil.copytree(small_engine.path, eng)
    m = json.loads((eng / "manifest.json").read_text())
    table, key = field.split(".")
    m[table][key] = value
    m["checksum"] = _checksum(m)
    (eng / "manifest.json").write_text(json.dumps(m))
    return eng


@pytest.mark.parametrize("field, value, says", [
    # a shape mismatch against the exported program (was: deep in the first step)
    ("build_config.max_seq_len", 2048, "manifest field 'build_config.max_seq_len' does not match "
     "bucket 1's program: state 'layers.2.ckv_nope' is [6, 40, 64] float8_e4m3fn in the program, "
     "[6, 512, 64] float8_e4m3fn from the manifest — restore it or rebuild"),
    ("build_config.max_seq_len", "abc", "manifest field 'build_config.max_seq_len' must be an "
     "int >= 1, got 'abc' — restore it or rebuild"),          # was: TypeError
    ("model_config.vocab_size", 1000, "manifest field 'model_config' does not describe the "
     "engine's weights: 'model.embed.weight' is [512, 256] bfloat16 in the weights file, "
     "[1000, 256] bfloat16 for model_config"),                                     # was: load_state_dict mismatch
    ("build_config.buckets", [1, 2, 4], "manifest field 'build_config.buckets' is [1, 2, 4], the "
     "engine's programs are for buckets [1, 2]"),
    ("build_config.target_programs", False, "manifest field 'build_config.target_programs' is "
     "false, the engine has target programs for buckets [1, 2] — restore it or rebuild"),
    ("build_config.max_rows", 10 ** 9, "the decode state for the manifest's "
     "build_config.max_rows=1000000000 and build_config.max_seq_len=160 needs "),
])
def test_a_hand_edited_manifest_names_the_field(small_engine, tmp_path, capsys, field, value,
                                                says):
    eng = _edited(small_engine, tmp_path, field, value)
    assert main(["run", str(eng), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 1
    assert says in _one_line_error(capsys.readouterr().err, "run")


def test_engine_load_names_a_state_field_the_programs_disagree_with(small_engine, tmp_path):
    """The library load too (not only the CLI): build_config.dtype edited."""
    from dspark_compile.engine_dir.format import ArtifactError
    from dspark_compile.runtime.engine import Engine
    eng = _edited(small_engine, tmp_path, "build_config.dtype", "float32")
    with pytest.raises(ArtifactError, match="manifest field 'build_config.dtype' does not match "
                                            "bucket 1's program") as e:
        Engine.load(eng, device="cpu")
    assert e.value.field == "build_config.dtype"


def test_inspect_checks_bucket_before_printing(small_engine, capsys):
    pytest.importorskip("onnx")
    assert main(["inspect", str(small_engine.path), "--onnx", "/tmp/never-written-x",
                 "--bucket", "3"]) == 1
    cap = capsys.readouterr()
    assert "--bucket 3: the engine has buckets [1, 2]" in _one_line_error(cap.err, "inspect")
    assert cap.out == ""


def _set_size(m):
    m["files"]["weights.safetensors"]["size"] = "abc"


def _programs_list(m):
    m["programs"] = [1]


def _weights_text(m):
    m["weights"] = "w"


def _bucket_text(m):
    m["buckets"] = ["1", "2"]


def _device_cuda(m):
    m["build_config"]["device"] = "cuda"


def _target_path(m):
    m["target_programs"]["1"]["path"] = "programs/step_b1.json"


@pytest.mark.parametrize("edit, says", [
    (_set_size, "manifest field 'files': entry 'weights.safetensors' is not a file entry"),
    (_programs_list, "manifest field 'programs' is a list, not a table"),
    (_weights_text, "manifest field 'weights' is not a table with 'file' and 'tensors'"),
    (_bucket_text, "manifest field 'buckets' must be a list of positive ints, got ['1', '2']"),
    # was: AssertionError: Torch not compiled with CUDA enabled
    (_device_cuda, "manifest field 'build_config.device' is 'cuda', the programs were built for "
                   "target_sm 'cpu'"),
    (_target_path, "manifest field 'target_programs.1.path': bucket 1's file "
                   "'programs/step_b1.json' is not programs/target_b1.json in the file table"),
])
def test_hand_edited_manifest_tables_are_named(small_engine, tmp_path, capsys, edit, says):
    import json

    from dspark_compile.engine_dir.format import _checksum
    eng = tmp_path / "engine"
    shutil.copytree(small_engine.path, eng)
    m = json.loads((eng / "manifest.json").read_text())
    edit(m)
    m["checksum"] = _checksum(m)
    (eng / "manifest.json").write_text(json.dumps(m))
    assert main(["run", str(eng), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 1
    assert says in _one_line_error(capsys.readouterr().err, "run")


def test_an_engine_file_replaced_by_a_directory_is_named(small_engine, tmp_path, capsys):
    eng = tmp_path / "engine"
    shutil.copytree(small_engine.path, eng)
    (eng / "programs" / "step.json").unlink()
    (eng / "programs" / "step.json").mkdir()
    assert main(["run", str(eng), "--prompt-ids", "1"]) == 1
    assert "engine file 'programs/step.json' is not a file" in _one_line_error(
        capsys.readouterr().err, "run")
