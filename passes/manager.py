"""PassManager: run a declared pipeline over an exported program, with instruments.

    pm = PassManager(config=PassConfig(verify=True, dump_dir="build/dumps"))
    stats = pm.run(ep, input_factory=make_inputs, state_inputs=("kv_cache",))
    print(pm.format_stats())

The order comes from the declarations (passes/registry.py). For every pass the manager records
wall time, node count before/after and the match count the pass returns, and can
- dump the readable graph before and after (`config.dump_dir`);
- verify numerics (`config.verify`): run the graph before and after the pass on fresh inputs
  from `input_factory(seed)` and raise `PassVerificationError` naming the pass on mismatch;
- warn (`PassNoMatchWarning`) when a pass declared `expect_match=True` matched nothing.

It also enforces the structural contract that keeps the program serialisable: placeholders are
untouched, every call node carries `meta["val"]` (torch.export.save fails otherwise:
docs/architecture.md, "Toolchain facts"), and the program's output signature follows nodes a
pass replaced.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Callable, Iterable, Optional, Sequence

import torch

from dspark_compile.passes.base import (
    PassConfig, PassContext, PassContractError, PassError, PassNoMatchWarning, PassResult,
    PassVerificationError, graph_module_of)
from dspark_compile.passes.registry import REGISTRY, PassRegistry, PassSpec
from dspark_compile.passes.verify import compare_runs, fresh_inputs, graph_inputs, run_graph

STATS_COLUMNS = ("index", "name", "stage", "time_ms", "nodes_before", "nodes_after", "matches",
                 "verified", "source_hash")


class PassManager:
    def __init__(self, passes: Optional[Iterable[str]] = None, config: Optional[PassConfig] = None,
                 registry: Optional[PassRegistry] = None, instruments: Sequence = ()):
        """`passes`: names to run (ordered by their declarations); None = the default pipeline.
        `instruments`: objects with optional `before_pass(spec, gm, ctx)` and
        `after_pass(spec, gm, ctx, row)` hooks."""
        self.config = config or PassConfig()
        self.registry = registry or REGISTRY
        self.pipeline: list[PassSpec] = self.registry.build_pipeline(passes, self.config)
        self.instruments = list(instruments)
        self.stats: list[dict] = []

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.pipeline]

    def manifest_entries(self) -> list[dict]:
        """The pass list for the engine manifest: name, stage and source hash, in run order."""
        return [{"name": s.name, "stage": s.stage, "source_hash": s.source_hash}
                for s in self.pipeline]

    # ------------------------------------------------------------------ running
    def run(self, program, input_factory: Optional[Callable] = None,
            state_inputs: Sequence[str] = ()) -> list[dict]:
        """Run the pipeline in place on `program` (an ExportedProgram or a GraphModule).

        `input_factory(seed) -> tuple of tensors` gives the program's *user* inputs (for a bare
        GraphModule: every placeholder); it is required when `config.verify` is set.
        `state_inputs` names the user inputs the program updates in place (caches); passes
        read them from `ctx.state_input_names`.
        """
        gm = graph_module_of(program)
        ep = None if isinstance(program, torch.fx.GraphModule) else program
        cfg = self.config
        if cfg.verify and input_factory is None:
            raise ValueError("PassConfig.verify needs an input_factory(seed) -> tuple of tensors")
        ctx = PassContext(config=cfg, exported_program=ep, state_input_names=tuple(state_inputs))
        gi = graph_inputs(ep, gm) if cfg.verify else None
        placeholders = [(n.name, n.target) for n in gm.graph.nodes if n.op == "placeholder"]
        self.stats = []
        for idx, spec in enumerate(self.pipeline):
            ctx.pass_name, ctx.notes = spec.name, {}
            for ins in self.instruments:
                getattr(ins, "before_pass", lambda *a: None)(spec, gm, ctx)
            nodes_before = len(gm.graph.nodes)
            self._dump(idx, spec, gm, "before")
            refs = []
            if cfg.verify:
                for k in range(cfg.verify_seeds):
                    seed = 1000 * (idx + 1) + k  # fresh inputs for every pass
                    inputs = fresh_inputs(input_factory, seed)
                    refs.append((seed, inputs, run_graph(gm, gi, inputs, seed)))

            existing = set(gm.graph.nodes)
            t0 = time.perf_counter()
            try:
                raw = spec.fn(gm, ctx)
            except PassError:
                raise
            except Exception as e:
                raise PassError(f"pass '{spec.name}' failed: {type(e).__name__}: {e}") from e
            elapsed = time.perf_counter() - t0
            result = PassResult.coerce(raw, spec.name)

            gm.graph.lint()
            gm.recompile()
            self._check_contract(spec, gm, placeholders, existing)
            if ep is not None:
                sync_output_signature(ep)
            self._dump(idx, spec, gm, "after")

            verified = None
            if cfg.verify:
                for seed, inputs, ref in refs:
                    got = run_graph(gm, gi, inputs, seed)
                    problems = compare_runs(ref, got, cfg.tolerances)
                    if problems:
                        raise PassVerificationError(
                            f"pass '{spec.name}' changed the program's results (seed {seed}):\n  "
                            + "\n  ".join(problems))
                verified = True
            if spec.expect_match and result.matches == 0:
                warnings.warn(f"pass '{spec.name}' is expected to match but matched nothing",
                              PassNoMatchWarning, stacklevel=2)
            row = {"index": idx, "name": spec.name, "stage": spec.stage,
                   "time_ms": round(elapsed * 1e3, 3), "nodes_before": nodes_before,
                   "nodes_after": len(gm.graph.nodes), "matches": result.matches,
                   "changed": result.changed if result.changed is not None else result.matches > 0,
                   "verified": verified, "source_hash": spec.source_hash,
                   "notes": {**ctx.notes, **result.notes}}
            self.stats.append(row)
            for ins in self.instruments:
                getattr(ins, "after_pass", lambda *a: None)(spec, gm, ctx, row)
        if cfg.dump_dir:
            with open(os.path.join(cfg.dump_dir, "passes.txt"), "w") as f:
                f.write(self.format_stats() + "\n")
        return self.stats

    __call__ = run

    # ------------------------------------------------------------------ instruments
    def _dump(self, idx: int, spec: PassSpec, gm: torch.fx.GraphModule, when: str) -> None:
        if not self.config.dump_dir:
            return
        os.makedirs(self.config.dump_dir, exist_ok=True)
        path = os.path.join(self.config.dump_dir, f"{idx:02d}_{spec.name}.{when}.txt")
        try:
            text = gm.print_readable(print_output=False)
        except TypeError:  # pragma: no cover - older signature
            text = gm.code
        with open(path, "w") as f:
            f.write(text)

    @staticmethod
    def _check_contract(spec: PassSpec, gm, placeholders, existing: set) -> None:
        now = [(n.name, n.target) for n in gm.graph.nodes if n.op == "placeholder"]
        if now != placeholders:
            raise PassContractError(
                f"pass '{spec.name}' changed the graph's placeholders (inputs); passes must not "
                f"add, remove or rename inputs: before {[p[0] for p in placeholders]}, "
                f"after {[p[0] for p in now]}")
        # only nodes the pass inserted: decomposed graphs already hold val-less assert nodes
        missing = [n.name for n in gm.graph.nodes
                   if n.op == "call_function" and n not in existing and "val" not in n.meta]
        if missing:
            raise PassContractError(
                f"pass '{spec.name}' left nodes without meta['val'] {missing}: copy it from the "
                "node they replace (torch.export.save needs it)")

    def format_stats(self, rows: Optional[list] = None) -> str:
        return format_stats_table(self.stats if rows is None else rows)


def format_stats_table(rows: list[dict]) -> str:
    """Fixed-width text table of the stats rows (source hashes shortened to 12 characters)."""
    cols = [c for c in STATS_COLUMNS]

    def cell(row, c):
        v = row.get(c)
        if c == "source_hash" and isinstance(v, str):
            return v[:12]
        if v is None:
            return "-"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    table = [cols] + [[cell(r, c) for c in cols] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def sync_output_signature(ep) -> None:
    """Make the program's output specs name the nodes the output node now returns (a pass
    that replaces an output-producing node leaves the signature pointing at the old name)."""
    from torch.export.graph_signature import TensorArgument

    out = next(n for n in reversed(ep.graph_module.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    specs = ep.graph_signature.output_specs
    if len(values) != len(specs):
        raise PassContractError(f"graph returns {len(values)} values, the program's signature "
                                f"declares {len(specs)} outputs; passes must keep outputs")
    for spec, v in zip(specs, values):
        if isinstance(spec.arg, TensorArgument) and isinstance(v, torch.fx.Node) \
                and spec.arg.name != v.name:
            spec.arg = TensorArgument(name=v.name)
