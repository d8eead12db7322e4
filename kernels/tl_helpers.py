"""Triton device helpers shared by the kernels, and the one way to launch a kernel.

The references in kernels/common.py define the numerics; these helpers reproduce them *bit for
bit* so that a kernel's FP8 bytes and scale bytes equal the reference's:

- `ue8m0_exponent(amax)`: the exponent e of the reference scale
  `2^ceil(log2(max(amax, 1e-4) / 448))`, in integer arithmetic. The reference computes the
  division and the log2 in fp32, and fp32 log2 of a value a few ulps above a power of two rounds
  *down onto* the integer (so ceil does not go up). Transcendental functions differ between
  Triton's interpreter (numpy), PTX `lg2.approx` and torch's CPU log2, so instead this helper
  decides that case exactly, as a correctly rounded log2 would. It was checked against torch's CPU
  `ue8m0_scale` on every exponent with mantissas around the boundary and on 2M random amax values
  (tests/kernels/test_act_quant.py keeps a sweep of it).
- `fp8e4m3_bits(x, SOFT)`: float32 in [-448, 448] -> e4m3 byte, round to nearest even (what the
  hardware `cvt.rn.satfinite.e4m3x2.f32` and torch's `.to(float8_e4m3fn)` do).
- `round_to(x, dtype, SOFT)`: round fp32 to `dtype` (nearest even) and return it as fp32 again,
  for math that continues on the rounded value (the reference rounds q after the norm, then
  rotates).

`SOFT` selects integer emulation of the casts. Triton's CPU interpreter converts fp32 -> bf16 by
truncation and fp32 -> fp8 without correct rounding, so launchers set SOFT=True exactly when the
kernel runs in the interpreter; on a GPU (SOFT=False) the hardware conversions are used, which
round to nearest even as well, so both paths compute the same bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.jit import JITFunction

from dspark_compile.kernels import interpreter_dot


def _device_calls_restore_language() -> None:
    """Make Triton's interpreter undo, when a jit function called from a kernel returns, the
    patches it applied to triton.language for that call.

    An interpreted launch (GridExecutor.__call__) patches the language modules found in the
    kernel's globals (`tl`: its builtins, tl.tensor, tl.math, tl.dtype.to_ir, ...) and restores
    them in a `finally`. A jit function *called* from the kernel (InterpretedFunction.__call__)
    patches the modules in its own globals the same way but drops the restore scope
    `_patch_lang` returns (triton 3.7.1). The launch's restore covers only what it patched
    itself, so a call into Triton's @jit standard library (tl.max, tl.sum, tl.argmax, ... in
    triton/language/standard.py, whose globals hold `triton.language.core`; tl.randint and co.
    in random.py, `core as tl`) leaves ~60 module functions of triton.language.core (add, load,
    arange, where, ...) as interpreter wrappers for the rest of the process. Real compilation
    reaches them through core's own globals (tensor.__add__ calls core's `add`), and the wrapper
    forces the interpreter's semantic onto IR values: every later triton.compile in the process
    fails ("'ir.block_argument' object has no attribute 'dtype'"), e.g. sm12x's cross-compile
    after any interpreted kernel test. This is that call with the restore; installed on import,
    before any of our kernels can run in the interpreter. A no-op for Triton builds without the
    restore scope."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    cls = getattr(interpreter, "InterpretedFunction", None)
    if cls is None or not hasattr(interpreter, "_LangPatchScope") or \
            getattr(cls.__call__, "_restores_language", False):
        return

    def __call__(self, *args, **kwargs):
        scope = interpreter._patch_lang(self.fn)
        try:
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise interpreter.InterpreterError(repr(e)) from e
        finally:
            scope.restore()     # back to the caller's (the launch's) patched state

    __call__._restores_language = True
    cls.__call__ = __call__


_device_calls_restore_language()
# tl.dot in the interpreter: one summation order on every CPU (kernels/interpreter_dot.py), so a
# test comparing an interpreted kernel's bits across shapes passes or fails on any machine alike
interpreter_dot.install()


def interpreting(kernel) -> bool:
    """True when `kernel` runs in Triton's CPU interpreter (TRITON_INTERPRET=1 at decoration)."""
    return not isinstance(kernel, JITFunction)


def launch(kernel):
    """`kernel` made traceable by torch (wrap_triton) when it is a real JIT kernel.

    torch 2.11's wrap_triton rejects interpreter kernels; the interpreter launches them directly.
    """
    if isinstance(kernel, JITFunction):
        from torch.library import wrap_triton
        return wrap_triton(kernel)
    return kernel


def multiprocessors(device) -> int:
    """The device's SM count, which sizes persistent grids; 1 for CPU tensors (the interpreter
    runs programs one after another, and a grid of one program per "SM" makes each program take
    several work items, the path the GPU takes)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def pdl_available(kernel, device) -> bool:
    """Programmatic dependent launch (`launch_pdl=True` with `pdl_enter` in the kernel): NVIDIA
    sm_90+ only, never in the interpreter."""
    return not interpreting(kernel) and torch.version.hip is None and \
        torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(pdl) -> dict:
    """Launch options of a kernel launched with programmatic dependent launch (pdl true or a
    PDL mode > 0), or none."""
    return dict(launch_pdl=True) if pdl else {}


# PDL (a kernel's constexpr): 0 off; 1 the next launch may start as soon as every program of
# this one has started; 2 only once every program has reached pdl_release (after its main loop).
PDL_MODES = {"off": 0, "early": 1, "late": 2}


def pdl_mode(pdl, default: str) -> int:
    """A launcher's `pdl` knob (True: its table's `default` mode, False: off, or a PDL_MODES
    key) as the kernels' PDL constexpr; anything else is an error naming the knob."""
    key = default if pdl is True else "off" if pdl is False else pdl
    if key not in PDL_MODES:
        raise ValueError(f"pdl must be True, False or one of {sorted(PDL_MODES)}, got {pdl!r}")
    return PDL_MODES[key]


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Start of a kernel launched with programmatic dependent launch: wait until the launches
    before this one have finished and their writes are visible (PDL 1 first lets the next
    launch's programs start; they wait in their own pdl_enter). Called before the kernel touches
    memory any earlier launch of the op writes or reads, it keeps the launches' order as plain
    launches have it; what PDL saves is the launch latency between them. No-op when PDL is 0."""
    if PDL == 1:
        gdc_launch_dependents()
    if PDL != 0:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """PDL 2: the next launch may start once every program of this one got here (a program that
    exits first counts as having got here). Programs the next launch starts early hold SM slots
    while they wait and are placed wherever slots were free: a kernel that triggers at its start
    may crowd its successor onto a few SMs (the likely reason PDL 1 measured slower than PDL 2
    at 4 rows on the H200, sampling.plan.PDL_BY_TILE; not measured directly)."""
    if PDL == 2:
        gdc_launch_dependents()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def ue8m0_exponent(amax):
    """int32 e with 2^e == reference ue8m0_scale(amax); amax fp32 >= 0 (finite).

    Integer math in int64: per group only, and Triton's interpreter checks every int32 add for
    overflow, which made it the bulk of interpreted test time."""
    a = tl.maximum(amax, 1e-4)
    bits = a.to(tl.int32, bitcast=True).to(tl.int64)  # int64: no overflow checks in the interpreter
    E = (bits >> 23) & 0xFF
    M = (bits & 0x7FFFFF) | 0x800000           # 24-bit significand, a normal (a >= 1e-4)
    # a / 448 = (4M/7) * 2^(E-158). When M >= 1.75 * 2^23, RN(4M/7) = (4M+3)//7 is the 24-bit
    # significand of the fp32 quotient y = 2^k (1 + j 2^-23) with k = E - 135; otherwise the
    # quotient's significand is >= 8/7 and ceil(log2 y) = E - 135 with no ambiguity.
    k = E - 135
    j = (4 * M + 3) // 7 - 8388608
    # fp32 log2(y) = k + log2(1 + j 2^-23) rounds onto k (ceil stays k) while log2(1 + j 2^-23)
    # is under half the spacing of fp32 numbers next to k: j <= J(k), with n = k (k > 0) or
    # -k-1 (k <= 0) and J = floor(ln2 * 2^(floor(log2 n) - 1)).
    n = tl.where(k > 0, k, -k - 1)
    J = tl.where(n >= 64, 22, tl.where(n >= 32, 11, tl.where(n >= 16, 5,
                 tl.where(n >= 8, 2, tl.where(n >= 4, 1, 0)))))
    up = (M > 14680064) & (j > J)               # 14680064 = 7 * 2^21
    return (k + up.to(tl.int64)).to(tl.int32)


@triton.jit
def exp2_int(e):
    """2.0**e as fp32 for int32 e in [-126, 127], exactly (built from the exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8e4m3_bits(x, SOFT: tl.constexpr):
    """fp32 x in [-448, 448] -> uint8 float8_e4m3fn byte (round to nearest even, -0 kept)."""
    if SOFT:
        b = x.to(tl.int32, bitcast=True).to(tl.int64)   # sign-extended; int64 math is unchecked
        sign = (b >> 24) & 0x80
        a = b & 0x7FFFFFFF
        E = a >> 23
        # normal e4m3 (|x| >= 2^-6): keep 3 mantissa bits with round-half-even, rebias 127 -> 7
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
        # subnormal e4m3: round(|x| * 2^9) half-even from the 24-bit significand; >= 2^25 = 0
        m24 = (a & 0x7FFFFF) | 0x800000
        s = tl.minimum(141 - E, 31)
        sub = (m24 + (1 << (s - 1)) - 1 + ((m24 >> s) & 1)) >> s
        code = tl.where(E >= 121, normal, sub)
        return (sign | code).to(tl.uint8)
    else:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def round_to(x, dtype: tl.constexpr, SOFT: tl.constexpr):
    """fp32 -> dtype (round to nearest even) -> fp32; an exact no-op for dtype fp32."""
    if dtype == tl.float32:
        return x
    elif SOFT and dtype == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True).to(tl.int64)   # low 32 bits behave as uint32
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return r.to(tl.int32).to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


def compile_config(kernel, types: dict, constexprs: dict, num_warps: int):
    """One `add_compile_configs` entry: (kernel, signature, constexprs, num_warps).

    `types` gives every runtime argument's Triton type ("*bf16", "i64", "fp32", ...; "i32:16" for
    an integer the launch passes as a multiple of 16, as Triton's JIT specialises it);
    `constexprs` every constexpr's value. The signature is built in parameter order with
    "constexpr" for the constexprs, as Triton's own JIT builds it; a missing or unknown name is
    an error here rather than a confusing compiler failure later.
    """
    names = list(kernel.arg_names)
    unknown = (set(types) | set(constexprs)) - set(names)
    missing = set(names) - set(types) - set(constexprs)
    if unknown or missing:
        raise ValueError(f"compile config of {kernel.__name__}: unknown {sorted(unknown)}, "
                         f"missing {sorted(missing)}")
    signature = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    return (kernel, signature, dict(constexprs), int(num_warps))
