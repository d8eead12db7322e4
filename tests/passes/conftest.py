"""Fixtures for the pass tests: the toy step (tests/passes/toy_step.py), loaded once by path
because tests are not a package (pytest runs with --import-mode=importlib)."""
import importlib.util
import sys
from pathlib import Path

import pytest


def load_toy():
    name = "dspark_tests_toy_step"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("toy_step.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


load_toy()  # also registers dspark_test::ring_store, which some tests call directly


@pytest.fixture(scope="session")
def toy():
    return load_toy()


@pytest.fixture
def toy_export(toy):
    """(eager model, freshly exported program) — passes mutate the program, so one per test."""
    return toy.export_toy()
