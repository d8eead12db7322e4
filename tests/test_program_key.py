"""ProgramKey: the one name of a program for the build, the manifest, the loader and the runtime.
Its file names and manifest keys are the ones engines built before it carry, so they still load."""
import pytest

from dspark_compile.engine_dir.format import (PREFILL, PROGRAM_TABLES, STEP, TARGET, ProgramKey)


def test_names_and_paths_are_the_engine_formats():
    assert ProgramKey(STEP, 16).path == "programs/step_b16.json"
    assert ProgramKey(TARGET, 16).path == "programs/target_b16.json"
    assert ProgramKey(PREFILL, 64).path == "programs/prefill_c64.json"
    assert ProgramKey(STEP, 16).compiled_path == "compiled/step_b16.bin"
    assert ProgramKey(STEP, 16, "greedy").compiled_path == "compiled/step_b16_greedy.bin"
    assert ProgramKey(PREFILL, 64).compiled_path == "compiled/prefill_c64.bin"
    assert [ProgramKey(k, 4).table for k in (STEP, TARGET, PREFILL)] == [
        "programs", "target_programs", "prefill_programs"]
    assert set(PROGRAM_TABLES) == {"programs", "target_programs", "prefill_programs"}
    # listed together (pass statistics, compiled tables): a step by its bucket, others by stem
    assert [ProgramKey(k, 4).listed for k in (STEP, TARGET, PREFILL)] == [
        "4", "target_b4", "prefill_c4"]
    assert ProgramKey(STEP, 4).label == "for bucket 4" and ProgramKey(PREFILL, 4).label == \
        "prefill_c4"


@pytest.mark.parametrize("key", [ProgramKey(STEP, 1), ProgramKey(STEP, 128, "greedy"),
                                 ProgramKey(TARGET, 7), ProgramKey(PREFILL, 512)])
def test_a_listed_name_reads_back_as_its_key(key):
    assert ProgramKey.of_listed(key.listed, key.variant) == key
    assert key.with_variant("full").with_variant(key.variant) == key


@pytest.mark.parametrize("name", ["", "b16", "step_b", "prefill_c-1", "target_c4", "prefill_b4",
                                  "step_b16.json", "x" * 10, "1.5"])
def test_a_name_that_is_no_program_is_refused(name):
    with pytest.raises(ValueError, match="names no program"):
        ProgramKey.of_listed(name)


@pytest.mark.parametrize("args, match", [
    (("decode", 4), "program kind must be one of"),
    ((STEP, 0), "size must be an int >= 1"),
    ((STEP, True), "size must be an int >= 1"),
    ((STEP, "4"), "size must be an int >= 1"),
    ((STEP, 4, "fast"), "variant must be one of"),
])
def test_a_bad_key_is_refused_naming_what(args, match):
    with pytest.raises(ValueError, match=match):
        ProgramKey(*args)


def test_keys_sort_and_hash_as_values():
    keys = [ProgramKey(STEP, 16), ProgramKey(STEP, 1), ProgramKey(PREFILL, 64),
            ProgramKey(STEP, 1, "greedy")]
    assert sorted(keys)[0] == ProgramKey(PREFILL, 64)          # by kind, size, variant
    assert len({*keys, ProgramKey(STEP, 1)}) == 4
    assert str(ProgramKey(STEP, 1, "greedy")) == "step_b1 (greedy)"
