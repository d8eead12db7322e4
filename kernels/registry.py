"""The one way to register a kernel as a `dspark::` op.

Every fused op in this package is declared with :func:`dspark_op` on its CUDA launcher:

    @dspark_op("qkv_postprocess", mutates_args={"cache"}, reference=qkv_postprocess_reference,
               fake=_qkv_postprocess_fake)
    def qkv_postprocess(q: Tensor, ..., cache: Tensor) -> Tensor:
        ...  # launch the Triton kernel through wrap_triton

The registered op dispatches on the device of its tensor arguments: CUDA tensors run the
decorated launcher (Triton), anything else runs the plain-PyTorch `reference` (so every op has
a CPU implementation and the reference is the single source of truth for the numerics). `fake`
gives shapes for export; it is required because under TRITON_INTERPRET=1 torch cannot derive it.
An op whose fused kernel does not exist yet decorates a function that calls the reference.

`KERNELS` maps op name -> :class:`KernelSpec` so tests and the SM12x resource check can
enumerate every kernel without a second list to keep in sync.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

NAMESPACE = "dspark"


@dataclass
class KernelSpec:
    name: str
    op: object  # the torch.ops.dspark.<name> overload packet
    reference: Callable
    launcher: Callable
    mutates_args: tuple = ()
    # Triton kernels (jit functions) this op launches, with the launch configurations it may use.
    # Each entry: (jit_fn, signature dict, constexprs dict, num_warps). Filled by the kernel file
    # through `add_compile_configs`; the SM12x resource test compiles every entry.
    compile_configs: list = field(default_factory=list)


KERNELS: dict[str, KernelSpec] = {}


def _on_cuda(args, kwargs) -> bool:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.is_cuda
    return False


def dspark_op(name: str, *, reference: Callable, fake: Callable, mutates_args=()):
    """Register `dspark::<name>`: the decorated launcher on CUDA, `reference` elsewhere."""

    def deco(launcher: Callable):
        if name in KERNELS:
            raise RuntimeError(f"dspark::{name} registered twice")

        @functools.wraps(launcher)
        def impl(*args, **kwargs):
            if _on_cuda(args, kwargs):
                return launcher(*args, **kwargs)
            return reference(*args, **kwargs)

        # custom_op, not triton_op: Inductor then keeps each dspark:: op one opaque call of
        # this launcher. triton_op would let it trace into the launcher (every kernel's
        # mutation analysis at compile time, the launcher's scratch tensors folded as
        # constants) for no gain under the CUDA graph the runtime captures anyway.
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=tuple(mutates_args))
        op.register_fake(fake)
        KERNELS[name] = KernelSpec(name, getattr(torch.ops.dspark, name), reference, launcher,
                                   tuple(mutates_args))
        return op

    return deco


def add_compile_configs(name: str, configs: list) -> None:
    """Declare the (kernel, signature, constexprs, num_warps) configurations `name` may launch."""
    KERNELS[name].compile_configs.extend(configs)
