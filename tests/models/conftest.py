"""Shared fixtures: one synthetic tiny checkpoint per test session, and model builders."""
import pytest
import torch

from dspark_compile.models import load_model
from dspark_compile.models.checkpoint import load_checkpoint
from dspark_compile.models.config import Precision
from dspark_compile.factory.synth import synth_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    synth_checkpoint("tiny", out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_tensors(tiny_ckpt):
    return load_checkpoint(tiny_ckpt)


@pytest.fixture(scope="session")
def make_model(tiny_tensors):
    cfg, tensors = tiny_tensors

    def make(prec=None, with_draft=True, max_positions=1024):
        return load_model(None, prec or Precision(dtype=torch.float64), max_positions, with_draft,
                          tensors=tensors, cfg=cfg)

    return make
