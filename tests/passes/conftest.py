"""Fixtures for the pass tests: the toy step (tests/passes/toy_step.py), loaded once by path
because tests are not a package (pytest runs with --import-mode=importlib)."""
import importlib.util
import sys
from pathlib import Path

import pytest


def _load(name: str, file: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def load_toy():
    return _load("dspark_tests_toy_step", "toy_step.py")


def load_tiny_step():
    """tests/passes/tiny_step.py: the tiny model's exported step (fusion-pass tests)."""
    return _load("dspark_tests_tiny_step", "tiny_step.py")


load_toy()  # also registers dspark_test::ring_store, which some tests call directly


@pytest.fixture(scope="session")
def toy():
    return load_toy()


@pytest.fixture
def toy_export(toy):
    """(eager model, freshly exported program) — passes mutate the program, so one per test."""
    return toy.export_toy()


@pytest.fixture(scope="session")
def tiny_step_lib():
    """tests/passes/tiny_step.py as a module, for tests that build their own TinyStep (the GPU
    ones): without the session's fp64 CPU export that `tiny_step` makes."""
    return load_tiny_step()


@pytest.fixture(scope="session")
def tiny_step(tmp_path_factory):
    """The tiny model and its step exported once per session (bucket 2, fp64, FP8 simulated);
    tests take copies (`.program()`, `.cleaned()`)."""
    mod = load_tiny_step()
    return mod.TinyStep(tmp_path_factory.mktemp("tiny_step"))
