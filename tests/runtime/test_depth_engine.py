"""The depth preset end to end on the CPU: `synth --preset tiny-deep` (Flash-0731's 43 target
layers with their layer types and hash layers, the 3-stage draft) built by the CLI, loaded and
run with `--check-lossless`: the engine's greedy speculative output equals its own target-only
decoding and the eager reference's, at full depth.

The build is the CLI's with target-only programs, kept small where depth does not matter: one
bucket (a dynamic batch's export costs ~1.5x a static one's; tests/passes/test_dynamic_batch.py
shows the dynamic program equal to the static ones), float64, max-seq-len 64, no prefill
programs (the prefill program's own tests cover it). Most of its time is the two exports (the
step program has ~45k nodes before the passes: 15 min on a 2-core machine under load ~5 with
two buckets); the engine is built once."""
import pytest

from dspark_compile.cli.main import main
from dspark_compile.engine_dir.load import load_manifest

FLASH_LAYERS = 43


@pytest.fixture(scope="module")
def deep_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("depth_engine")
    assert main(["synth", "--preset", "tiny-deep", "--out", str(root / "ckpt")]) == 0
    rc = main(["build", str(root / "ckpt"), "--out", str(root / "engine"), "--buckets", "1",
               "--max-seq-len", "64", "--dtype", "float64", "--device", "cpu",
               "--prefill-chunks", "none"])
    assert rc == 0
    return root / "engine"


def test_the_depth_engine_holds_every_layer(deep_engine):
    m = load_manifest(deep_engine)
    assert m["model_config"]["num_hidden_layers"] == FLASH_LAYERS
    assert {e["path"] for e in m["programs"].values()} == {"programs/step_b1.json"}
    assert {e["path"] for e in m["target_programs"].values()} == {"programs/target_b1.json"}


def test_the_depth_engine_is_lossless(deep_engine, capsys):
    rc = main(["run", str(deep_engine), "--prompt-ids", "3,1,4,1,5", "--prompt-ids", "9,2,6",
               "--max-new-tokens", "8", "--check-lossless", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    # speculative vs the engine's target-only decoding (bit-exact), then that vs the eager
    # reference (float64: equal too)
    assert out.strip().splitlines()[-2:] == ["lossless: ok", "reference: ok"]
    tokens = [line for line in out.splitlines() if line.startswith("tokens[")]
    assert len(tokens) == 2 and all(len(t.split(": ")[1].split(",")) == 8 for t in tokens)
