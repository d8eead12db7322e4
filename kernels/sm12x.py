"""SM12x readiness: cross-compile every declared kernel configuration for sm_120 / sm_121.

Consumer and workstation Blackwell (SM120, SM121) give a block at most 99 KB of shared memory, and
a kernel tuned on an H200 can silently spill there. No GPU is needed to check: Triton compiles for
`GPUTarget("cuda", 120, 32)` on any machine, and the `cuobjdump` bundled with Triton reports each
cubin's registers (REG), static shared memory (SHARED) and local memory (LOCAL, i.e. spills or
stack arrays). Triton's own shared memory is *dynamic* and not in SHARED, so the check adds the
compiled kernel's `metadata.shared`.

`resource_report(arch)` compiles every entry that kernel files declared through
`registry.add_compile_configs` (after importing every module of this package, so kernels added
later are picked up without a list to update) and returns one dict per configuration. Signature
types are Triton's ("*bf16", "i32", "fp32", "constexpr"); "i32:16" marks an integer the launch
passes as a multiple of 16 (Triton's JIT specialises on that, and it enables vector loads);
`dspark-compile build --arch sm_120` stores it in the engine manifest. `check_report` raises on
any configuration over the limits.

Works under TRITON_INTERPRET=1 too (tests set it): `triton.jit` then returns interpreter objects,
for our kernels and for Triton's own @jit standard library (tl.max, tl.sum, tl.philox, ...), so
each kernel -- and every jit function it reaches, through globals or through `tl` -- is rebuilt as
a real `JITFunction` from the same Python source before compiling.
"""
from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import re
import subprocess
import tempfile
import types

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from dspark_compile.kernels.registry import KERNELS

ARCHS = {"sm_120": 120, "sm_121": 121}
SMEM_LIMIT_BYTES = 99 * 1024   # per block, SM120/SM121
WARP_SIZE = 32


def import_all_kernel_modules() -> list[str]:
    """Import every module of dspark_compile.kernels, subpackages included, so that all ops and
    configs are registered."""
    pkg = importlib.import_module(__package__)
    names = []
    for info in pkgutil.walk_packages(pkg.__path__, f"{__package__}."):
        importlib.import_module(info.name)
        names.append(info.name)
    return names


def as_jit(kernel) -> JITFunction:
    """A compilable JITFunction for `kernel`, also when Triton's interpreter decorated it."""
    if isinstance(kernel, JITFunction):
        return kernel
    fn = getattr(kernel, "fn", None)
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"{kernel!r} is neither a triton.jit kernel nor an interpreted one")
    return _rebuild(fn)


_REBUILT: dict = {}


def _rebuild(fn: types.FunctionType) -> JITFunction:
    # Same code object (so Triton reads the same source), fresh globals in which every interpreted
    # helper is replaced by its rebuilt JITFunction (Triton resolves calls through __globals__).
    if fn in _REBUILT:
        return _REBUILT[fn]
    scope = dict(fn.__globals__)
    clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    functools.update_wrapper(clone, fn)
    del clone.__wrapped__  # inspect must read clone's own (identical) source, not follow fn
    jit = _REBUILT[fn] = JITFunction(clone)   # memoised before recursing: helpers call each other
    for name, value in fn.__globals__.items():
        if _is_interpreted(value) or _is_triton_language(value):
            scope[name] = _compilable(value)
    return jit


def _compilable(value):
    return _rebuild(value.fn) if _is_interpreted(value) else _language_proxy(value)


def _is_triton_language(value) -> bool:
    return isinstance(value, types.ModuleType) and value.__name__.startswith("triton.language")


def _language_proxy(mod: types.ModuleType) -> types.ModuleType:
    """A copy of a triton.language module whose interpreted jit functions (tl.max, tl.sum,
    tl.philox, ... are @jit functions of Triton's own standard library) are rebuilt too."""
    if mod in _REBUILT:
        return _REBUILT[mod]
    proxy = _REBUILT[mod] = types.ModuleType(mod.__name__, mod.__doc__)
    proxy.__dict__.update(vars(mod))
    for name, value in vars(mod).items():
        if _is_interpreted(value) or (_is_triton_language(value) and value is not mod):
            setattr(proxy, name, _compilable(value))
    return proxy


def _is_interpreted(obj) -> bool:
    return type(obj).__name__ == "InterpretedFunction" and isinstance(getattr(obj, "fn", None),
                                                                       types.FunctionType)


def _split_signature(jit: JITFunction, signature: dict):
    """(plain signature, attrs). Pointers are taken 16-byte aligned (torch allocations are, and
    Triton's JIT specialises on it); an integer typed "i32:16" is one the launch passes as a
    multiple of 16, which the JIT marks the same way. Without these the compiler would not
    vectorise, and the registers counted would not be those of the launched kernel."""
    plain, attrs = {}, {}
    for i, name in enumerate(jit.arg_names):
        ty = str(signature[name])
        base, _, div = ty.partition(":")
        plain[name] = base
        if base.startswith("*") or div == "16":
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif div:
            raise ValueError(f"{jit.__name__}.{name}: unknown type annotation {ty!r}")
    return plain, attrs


def interpreter_patches() -> list[str]:
    """The triton.language attributes that currently hold objects made by Triton's interpreter.

    The interpreter swaps language functions for wrappers that force its own (numpy) semantic
    while it runs a kernel and is meant to put them back afterwards. One left behind makes real
    compilation feed IR values to the interpreter ("'ir.block_argument' object has no attribute
    'dtype'", far from the cause), so compile_entry checks first and names them."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return []
    import triton.language as tl
    src = interpreter.__file__

    def made_there(v):
        if isinstance(v, functools.partial):
            v = v.func
        elif isinstance(v, property):
            v = v.fget
        return getattr(getattr(v, "__code__", None), "co_filename", None) == src

    spaces = {"triton.language": tl, "triton.language.core": tl.core,
              "triton.language.math": tl.math, "tl.tensor": tl.tensor, "tl.dtype": tl.dtype,
              "tl.tensor_descriptor_base": tl.core.tensor_descriptor_base}
    return [f"{where}.{name}" for where, ns in spaces.items()
            for name, v in list(vars(ns).items()) if made_there(v)]


def compile_entry(entry, capability: int):
    """Compile one (kernel, signature, constexprs, num_warps) entry for sm_<capability>."""
    leaked = interpreter_patches()
    if leaked:
        raise RuntimeError(
            f"Triton's interpreter left {len(leaked)} triton.language attributes patched "
            f"({', '.join(leaked[:6])}, ...): real compilation in this process would run its "
            "semantic on IR. Some interpreted call path did not restore them (jit functions "
            "called from interpreted kernels restore theirs once tl_helpers is imported).")
    kernel, signature, constexprs, num_warps = entry
    jit = as_jit(kernel)
    plain, attrs = _split_signature(jit, signature)
    src = ASTSource(jit, plain, dict(constexprs), attrs)
    target = GPUTarget("cuda", capability, WARP_SIZE)
    return triton.compile(src, target=target, options={"num_warps": num_warps})


def cuobjdump_path() -> str:
    try:
        from triton import knobs
        path = knobs.nvidia.cuobjdump.path
        if path and os.path.exists(path):
            return path
    except Exception:  # older layouts: fall back to the bundled binary
        pass
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"Triton's bundled cuobjdump not found at {path}")
    return path


_RES_RE = re.compile(r"\b(REG|STACK|SHARED|LOCAL|CONSTANT\[\d+\]|TEXTURE|SURFACE|SAMPLER):(\d+)")


def cubin_resources(cubin: bytes) -> dict:
    """`cuobjdump --dump-resource-usage` of a cubin: {"REG": .., "SHARED": .., "LOCAL": ..}."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump_path(), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    res = {k: int(v) for k, v in _RES_RE.findall(out)}
    missing = {"REG", "SHARED", "LOCAL"} - set(res)
    if missing:
        raise RuntimeError(f"cuobjdump output lacks {sorted(missing)}:\n{out}")
    return res


REGS_PER_SM = 65536            # sm_90, sm_120, sm_121
MAX_CTAS_PER_SM = 32


def ctas_by_registers(registers: int, num_warps: int) -> int:
    """CTAs per SM the register file allows (per-thread registers rounded up to 8)."""
    per_cta = -(-registers // 8) * 8 * WARP_SIZE * num_warps
    return min(MAX_CTAS_PER_SM, REGS_PER_SM // per_cta)


def _arch_capability(arch: str) -> int:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    return ARCHS[arch]


def config_resources(capability: int, ops: set[str] | None = None):
    """Every declared configuration (of the registered ops in `ops`; all if None) compiled for
    sm_<capability>: yields (record, compiled kernel), the record holding the op, kernel,
    num_warps, constexprs, registers, shared memory (static + Triton's dynamic), local memory
    and stack. Also what benchmarks/kernel_resources.py reports at any capability."""
    import_all_kernel_modules()
    for op_name in sorted(KERNELS):
        if ops is not None and op_name not in ops:
            continue
        for entry in KERNELS[op_name].compile_configs:
            kernel, _, constexprs, num_warps = entry
            compiled = compile_entry(entry, capability)
            res = cubin_resources(compiled.asm["cubin"])
            dyn = int(compiled.metadata.shared)
            yield {
                "op": op_name,
                "kernel": as_jit(kernel).__name__,
                "num_warps": num_warps,
                "constexprs": {k: _jsonable(v) for k, v in constexprs.items()},
                "registers": res["REG"],
                "shared_static_bytes": res["SHARED"],
                "shared_dynamic_bytes": dyn,
                "shared_bytes": res["SHARED"] + dyn,
                "local_bytes": res["LOCAL"],
                "stack_bytes": res.get("STACK", 0),
            }, compiled


def resource_report(arch: str) -> list[dict]:
    """One record per declared configuration of every registered kernel, compiled for `arch`."""
    capability = _arch_capability(arch)
    return [dict(r, arch=arch, ok=r["shared_bytes"] <= SMEM_LIMIT_BYTES and r["local_bytes"] == 0)
            for r, _ in config_resources(capability)]


def check_report(report: list[dict]) -> None:
    """Raise naming every configuration over SM12x's limits (shared memory, spills)."""
    bad = [f"{r['op']}/{r['kernel']} {r['arch']} warps={r['num_warps']} {r['constexprs']}: "
           f"shared {r['shared_bytes']} B (limit {SMEM_LIMIT_BYTES}), local {r['local_bytes']} B"
           for r in report if not r["ok"]]
    if bad:
        raise RuntimeError("kernel configurations exceed SM12x limits:\n  " + "\n  ".join(bad))


def _jsonable(v):
    return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)
