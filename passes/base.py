"""What every pass sees: its configuration, its context and what it returns.

A pass is `fn(gm, ctx) -> PassResult | int | None` over the `torch.fx.GraphModule` of an
`ExportedProgram` as exported (the non-functional IR: in-place cache updates stay in place, see
docs/architecture.md, "Toolchain facts"). `ctx` carries the explicit configuration (never
environment variables) and, when the manager runs on an `ExportedProgram`, the program itself
and the names of its state inputs.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


class PassError(RuntimeError):
    """Base class of every error raised by the pass infrastructure."""


class PassPipelineError(PassError):
    """The requested pipeline cannot be built (unknown pass, missing dependency, cycle)."""


class PassVerificationError(PassError):
    """A pass changed what the graph computes (numeric verification failed)."""


class PassContractError(PassError):
    """A pass broke a structural rule (placeholders changed, node without meta['val'], ...)."""


class PassNoMatchWarning(UserWarning):
    """A pass declared `expect_match=True` matched nothing."""


STAGES = ("cleanup", "fusion", "lint")
"""Coarse phases. Every pass of an earlier stage runs before every pass of a later one, so a
lint never has to list the fusions it must follow (soft ordering, like `after`)."""


@dataclass(frozen=True)
class PassConfig:
    """Explicit options of one pipeline run.

    disabled: pass names to leave out (a pass that `requires` a disabled one is an error).
    options: per-pass options, `{"fuse_sampler": {"vocab_chunk": 4096}}`; read with
        `ctx.options()` inside the pass.
    verify / verify_seeds: run each pass's graph before and after on `verify_seeds` fresh random
        input sets from the caller's `input_factory(seed)` and compare (see passes/verify.py).
    tolerances: dtype name -> (rtol, atol), overriding passes/verify.py's per-dtype defaults.
    dump_dir: write the readable graph before and after each pass there.
    target_device: "cuda"/"cpu"; informational for passes that need it (None: from the graph).
    """

    disabled: frozenset = frozenset()
    options: dict = field(default_factory=dict)
    verify: bool = False
    verify_seeds: int = 2
    tolerances: dict = field(default_factory=dict)
    dump_dir: Optional[str] = None
    target_device: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "disabled", frozenset(self.disabled))
        if self.verify_seeds < 1:
            raise ValueError(f"PassConfig.verify_seeds must be >= 1, got {self.verify_seeds}")

    def hash(self) -> str:
        """sha256 of what changes the *output* program (not dumps/verification)."""
        blob = json.dumps({"disabled": sorted(self.disabled), "options": self.options,
                           "target_device": self.target_device},
                          sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()


@dataclass
class PassContext:
    """Handed to every pass. `pass_name` is the pass being run (set by the manager)."""

    config: PassConfig = field(default_factory=PassConfig)
    exported_program: Any = None          # torch.export.ExportedProgram, when run on one
    state_input_names: tuple = ()         # user inputs the program updates in place (caches)
    pass_name: str = ""
    notes: dict = field(default_factory=dict)  # free-form per-pass notes for the stats table

    def options(self, name: Optional[str] = None) -> dict:
        return dict(self.config.options.get(name or self.pass_name, {}))


@dataclass
class PassResult:
    """What a pass reports. `matches` is the number of pattern instances it rewrote (or, for a
    lint, the number of nodes it checked); `changed` defaults to `matches > 0`."""

    matches: int = 0
    changed: Optional[bool] = None
    notes: dict = field(default_factory=dict)

    @classmethod
    def coerce(cls, value, pass_name: str) -> "PassResult":
        if isinstance(value, PassResult):
            return value
        if value is None:
            return cls(0)
        if isinstance(value, bool) or not isinstance(value, int):
            raise PassContractError(
                f"pass '{pass_name}' returned {type(value).__name__}; "
                "expected PassResult, int (match count) or None")
        return cls(int(value))


def graph_module_of(program) -> torch.fx.GraphModule:
    """The GraphModule of an ExportedProgram, or the GraphModule itself."""
    if isinstance(program, torch.fx.GraphModule):
        return program
    gm = getattr(program, "graph_module", None)
    if isinstance(gm, torch.fx.GraphModule):
        return gm
    raise TypeError(f"expected an ExportedProgram or GraphModule, got {type(program).__name__}")
