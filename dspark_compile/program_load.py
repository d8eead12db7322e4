"""Faster `torch.export.load` of the engine's programs.

torch's program deserializer (torch/_export/serde/serialize.py `_dict_to_dataclass`, torch 2.11
and 2.13) rebuilds every node, argument and tensor meta of the program's JSON as a schema
dataclass and calls `typing.get_type_hints(cls, globalns=vars(schema))` for each one: 126k
calls, 14 of the 48 s of a profiled load of the tiny engine's three step programs and one
prefill program on the H200 machine (benchmarks/load_time.py --profile). The hints of a schema
class never change, so inside `faster_deserialization()` the deserializer's `typing` is a
stand-in whose `get_type_hints` remembers its answer per (class, namespace); everything else
is the real module. Outside the block the deserializer is untouched.
"""
from __future__ import annotations

import contextlib
import threading
import types
import typing

_LOCK = threading.Lock()


class _MemoTyping(types.ModuleType):
    """`typing`, with get_type_hints memoised for the calls the deserializer makes."""

    def __init__(self):
        super().__init__("typing")
        self._hints: dict = {}

    def __getattr__(self, name):
        return getattr(typing, name)

    def get_type_hints(self, obj, globalns=None, localns=None, include_extras=False):
        if localns is not None or not isinstance(obj, type):
            return typing.get_type_hints(obj, globalns, localns, include_extras)
        key = (obj, id(globalns), include_extras)
        hints = self._hints.get(key)
        if hints is None:
            hints = self._hints[key] = typing.get_type_hints(obj, globalns, None, include_extras)
        return dict(hints)        # callers may not mutate the remembered answer


@contextlib.contextmanager
def faster_deserialization():
    """torch.export.load inside this block deserializes with memoised type hints."""
    try:
        from torch._export.serde import serialize
    except ImportError:           # another torch layout: load as torch does
        yield
        return
    with _LOCK:
        original = getattr(serialize, "typing", None)
        if original is not typing:     # not the layout measured above: leave it alone
            yield
            return
        serialize.typing = _MemoTyping()
        try:
            yield
        finally:
            serialize.typing = original
