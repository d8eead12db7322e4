"""The toolchain an engine is built with and run on (the manifest's environment fields)."""
from __future__ import annotations

import importlib.metadata
from typing import Optional

import torch

DISTRIBUTION = "dspark-compile"

ENV_FIELDS = ("dspark_compile_version", "torch_version", "triton_version", "cuda_version",
              "target_sm")


def package_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


def triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def cuda_version() -> Optional[str]:
    """CUDA version torch was built with (None for CPU-only wheels)."""
    return torch.version.cuda


def target_sm(device=None) -> str:
    """'sm_90' / 'sm_120' for the current (or given) CUDA device, 'cpu' without one."""
    if device is not None and torch.device(device).type != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def environment_fields(device=None) -> dict:
    """What an engine built here records, and what a load here expects."""
    return {
        "dspark_compile_version": package_version(),
        "torch_version": torch.__version__,
        "triton_version": triton_version(),
        "cuda_version": cuda_version(),
        "target_sm": target_sm(device),
    }
