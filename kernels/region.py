"""Mark each call of a reference function as a region of the exported graph, for fusion passes.

    @fusable("qkv_postprocess")
    def qkv_postprocess_reference(q, kv, positions, cos_sin, slots, cache_nope, ..., eps): ...

The models call the plain-PyTorch references, so the exported step holds their aten subgraphs
(hundreds of nodes each). Matching those structurally would break with every edit of a reference
and every torch version; instead the call says where it is. While `torch.export` traces with node
meta preserved (dspark_compile/build/pipeline.py wraps the export in
`torch.fx.traceback.preserve_node_meta()`), a decorated call

- runs under `torch.fx.traceback.annotate(...)`, so every node it creates carries
  `meta["custom"] = {REGION: op name, CALL: unique id, CONSTS: {non-tensor arguments},
  TENSOR_ARGS: [names of its tensor arguments], ...}`;
- passes each tensor argument through an `aten.alias` marker annotated `ARG: <parameter name>`
  (a view: writes through it still land in the caller's cache, so in-place semantics hold),
- and returns each output tensor through an `aten.alias` marker annotated `OUT: <index>`.

A fusion pass (passes/fuse_*.py, through passes/regions.py) replaces the region by one call of
`torch.ops.dspark.<op name>` on the markers' inputs plus the constants: the op and the reference
have the same parameter names, so arguments are bound by name. The cleanup passes keep markers
(passes/remove_noops.py skips them); whatever fusion is disabled, a later pass drops the
remaining markers (passes/drop_region_markers.py).

Only the outermost decorated call is a region: `qkv_postprocess_reference` calling
`qkv_rope_reference` is one qkv_postprocess region. Outside of FX tracing (eager, the CPU
implementation of the `dspark::` ops themselves) the wrapper checks one flag and calls the
function: no markers, no change in numerics. Without `torch.fx.traceback.annotate` (an old
torch) or without preserved node meta, calls are not marked and the fusion passes find nothing
(they warn, `expect_match=True`).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
from typing import Callable

import torch

# Keys of node.meta["custom"]. Everything this module writes starts with "dspark_".
REGION = "dspark_region"          # op name, on every node of the region
CALL = "dspark_call"              # unique int per traced call, on every node of the region
CONSTS = "dspark_consts"          # {parameter name: value} of the non-tensor arguments
TENSOR_ARGS = "dspark_tensor_args"  # parameter names of the tensor arguments, in order
ARG = "dspark_arg"                # on an argument marker: its parameter name
OUT = "dspark_out"                # on an output marker: its index in the returned tuple (0 for a
#                                   single tensor)
NUM_OUT = "dspark_num_out"        # on an output marker: how many tensors the call returned, -1
#                                   when it returned one bare tensor (not a tuple)

_annotate = getattr(torch.fx.traceback, "annotate", None)
_has_preserved_node_meta = getattr(torch.fx.traceback, "has_preserved_node_meta", None)

try:  # the active FX tracer (make_fx / export), pre-dispatch included
    from torch.fx.experimental.proxy_tensor import get_proxy_mode as _get_proxy_mode
except ImportError:  # pragma: no cover - torch without it: never mark
    _get_proxy_mode = None

_ids = itertools.count()
# constants a region may carry (they travel in node meta, which torch.export.save writes as JSON)
_CONST_TYPES = (type(None), bool, int, float, str)
_local = threading.local()

FUSABLE: dict[str, Callable] = {}
"""op name -> decorated reference function (tests enumerate it)."""


# Dynamo (torch.compile of a reference, the benchmarks' baseline) folds this to True and traces
# the plain function: no graph break, no markers.
_is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)
_SUPPORTED = None not in (_annotate, _has_preserved_node_meta, _get_proxy_mode)


def annotations_supported() -> bool:
    """This torch can mark regions (`annotate`, `has_preserved_node_meta`, `get_proxy_mode`)."""
    return _SUPPORTED


def _marking() -> bool:
    """True while an FX tracer with preserved node meta records ops, outside any region."""
    if not _SUPPORTED or _is_dynamo_compiling() or getattr(_local, "depth", 0):
        return False
    return _get_proxy_mode() is not None and _has_preserved_node_meta()


def _marker(t: torch.Tensor, key: str, value, extra: dict | None = None) -> torch.Tensor:
    with _annotate({key: value, **(extra or {})}):
        return torch.ops.aten.alias.default(t)


@contextlib.contextmanager
def fused_eager():
    """Eager calls of decorated references run `torch.ops.dspark.<op>` instead, as the fused
    engine does: on CUDA tensors the Triton kernels, elsewhere the reference itself. The model
    then runs the engine's kernels with aten glue between them, which is what an eager check of
    the kernels' batch invariance needs (tests, benchmarks/invariance_probe.py)."""
    before = getattr(_local, "fused", False)
    _local.fused = True
    try:
        yield
    finally:
        _local.fused = before


def _call_op(op_name: str, sig: inspect.Signature, args, kwargs):
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    _local.depth = getattr(_local, "depth", 0) + 1   # the op's own reference runs as itself
    try:
        return getattr(torch.ops.dspark, op_name)(**bound.arguments)
    finally:
        _local.depth -= 1


def fusable(op_name: str):
    """Decorator for a reference function whose calls a fusion pass replaces by
    `torch.ops.dspark.<op_name>` (same parameter names, same returns)."""

    def deco(fn: Callable) -> Callable:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not _marking():
                if getattr(_local, "fused", False) and not getattr(_local, "depth", 0):
                    return _call_op(op_name, sig, args, kwargs)
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            tensors = [k for k, v in bound.arguments.items() if isinstance(v, torch.Tensor)]
            consts = {k: v for k, v in bound.arguments.items() if k not in tensors}
            if not all(isinstance(v, _CONST_TYPES) for v in consts.values()):
                return fn(*args, **kwargs)  # not expressible as op constants: leave unmarked
            region = {REGION: op_name, CALL: next(_ids), CONSTS: consts, TENSOR_ARGS: tensors}
            _local.depth = getattr(_local, "depth", 0) + 1
            try:
                with _annotate(region):
                    for k in tensors:
                        bound.arguments[k] = _marker(bound.arguments[k], ARG, k)
                    out = fn(*bound.args, **bound.kwargs)
                    if isinstance(out, torch.Tensor):
                        return _marker(out, OUT, 0, {NUM_OUT: -1})
                    if isinstance(out, tuple) and all(isinstance(o, torch.Tensor) for o in out):
                        return tuple(_marker(o, OUT, j, {NUM_OUT: len(out)})
                                     for j, o in enumerate(out))
                    return out  # None (ops that only write their arguments)
            finally:
                _local.depth -= 1

        wrapper.__wrapped_reference__ = fn
        wrapper.dspark_region = op_name
        FUSABLE[op_name] = wrapper
        return wrapper

    return deco
