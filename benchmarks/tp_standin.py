"""MEASUREMENT STAND-IN, benchmarks only (never used by run / serve): one rank's engine programs
of a tensor-parallel engine run in ONE process with NO process group, each collective of its
programs replaced by a local op of the same shape and bytes (benchmarks/tp_step.py's one-GPU
mode: rank 0's step before communication, issue 53 item 5).

What the stand-in does (`LocalCollectives`):
  _c10d_functional.all_gather_into_tensor(x, group_size, group_name) -> [group_size * n, ...]:
      x in rank 0's block and ZEROS in the other ranks' blocks (one zero-fill of group_size x
      the bytes and one copy of x: the bytes a gather writes), i.e. what the gather writes when
      every other rank contributes zeros;
  _c10d_functional.wait_tensor(t) -> t.
Why zeros and not x repeated: every reduction of the sharded model is a gather then a sum in
rank order (models/parallel.py all_reduce), so with x repeated each all-reduce doubles its
partial sum (x tp): the residual stream grows layer after layer and the eager stand-in of
2026-12-07 died at B = 16 with an out-of-range id. With zeros the all-reduce gives rank 0's own
partial sum (finite when rank 0's activations are), the vocab-parallel embedding gives rank 0's
rows and zeros for the others', and the gathered logits (all_gather_last) are rank 0's vocab
block then zeros: finite logits over the whole vocabulary, so every sampled / argmax id is in
[0, V) without touching the program's sampler. The values differ from a real rank's (routing
too); the shapes, the kernels and the bytes moved are rank 0's.

The eager reference model (prefill of the benchmark's requests) gets the same stand-in through
`LocalParallelConfig` (its `_gather0`).

`rewrite_collectives(program, standin, tp)` rewrites one GraphProgram's nodes (before its
runner is built) and refuses a program with any other collective, naming the op;
`load_rank_standin(rank_dir)` loads one rank's engine directory (ENGINE/rank{r} of `build --tp`,
or `build_rank_standin`'s) with every program rewritten; `build_rank_standin` builds ONE rank's
engine in this process under torch.distributed's "fake" process group (no communication, what
export needs to trace the functional collectives), for a machine with fewer devices than ranks.
Checked on the CPU (2026-12-07, the tp checkpoint cut to 3 target layers, buckets 1 and 2,
float32): its step and greedy-step programs and its weight shard are byte-identical to rank0/ of
`build --tp 2` (two gloo processes) with the same build config.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_compile.engine_dir.graph_format import COLLECTIVES
from dspark_compile.models.parallel import ParallelConfig

STANDIN = "collectives replaced by local copies"
GATHER = "_c10d_functional.all_gather_into_tensor.default"
WAIT = "_c10d_functional.wait_tensor.default"
# any op of these namespaces is a collective: one this stand-in does not know is refused
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "c10d_functional", "_dtensor")


class StandinError(ValueError):
    """A program the stand-in cannot rewrite faithfully (an unexpected collective, a gather
    over another rank count)."""


class LocalCollectives:
    """The stand-in ops (module docstring), counting the gathers it runs while `counting`
    (an uncaptured step: a CUDA graph replay runs no Python)."""

    def __init__(self):
        self.counting = True
        self.reset()

    def reset(self) -> None:
        self.calls, self.bytes_in, self.bytes_out = 0, 0, 0

    def gather(self, x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
        n = x.shape[0]
        out = x.new_zeros((group_size * n, *x.shape[1:]))
        out[:n].copy_(x)
        if self.counting:
            self.calls += 1
            self.bytes_in += x.numel() * x.element_size()
            self.bytes_out += out.numel() * out.element_size()
        return out

    @staticmethod
    def wait(t: torch.Tensor) -> torch.Tensor:
        return t


def op_name(op) -> str:
    """"namespace.name.overload" of an OpOverload (graph_format's spelling); '' otherwise."""
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name.replace('::', '.')}.{op._overloadname}"
    return ""


def rewrite_collectives(program, standin: LocalCollectives, tp: int) -> dict:
    """Replace, in `program` (a GraphProgram, before its runner is built), every all-gather
    node by `standin.gather` and every wait_tensor by `standin.wait`; returns {op name: nodes
    rewritten}. StandinError for any other collective op or a gather over other than `tp`
    ranks, naming the program, the node and the op."""
    counts = {GATHER: 0, WAIT: 0}
    nodes = []
    for name, op, args, kwargs in program.nodes:
        full = op_name(op)
        if full == GATHER:
            if args[1] != tp:
                raise StandinError(f"program '{program.rel}': node '{name}' gathers over "
                                   f"{args[1]} ranks, the engine has tp = {tp}")
            op = standin.gather
        elif full == WAIT:
            op = standin.wait
        elif full in COLLECTIVES or full.split(".")[0] in _COLLECTIVE_NAMESPACES:
            raise StandinError(f"program '{program.rel}': node '{name}' calls {full}, a "
                               f"collective the local stand-in does not replace (it replaces "
                               f"{GATHER} and {WAIT} only)")
        else:
            nodes.append((name, op, args, kwargs))
            continue
        counts[full] += 1
        nodes.append((name, op, args, kwargs))
    if counts[GATHER] != counts[WAIT]:
        raise StandinError(f"program '{program.rel}': {counts[GATHER]} gathers but "
                           f"{counts[WAIT]} waits")
    program.nodes = nodes
    return counts


def count_collectives(program) -> dict:
    """{op name: nodes} of the collective ops in `program` (before or after a rewrite)."""
    out: dict = {}
    for _, op, _, _ in program.nodes:
        full = op_name(op)
        if full in COLLECTIVES or full.split(".")[0] in _COLLECTIVE_NAMESPACES:
            out[full] = out.get(full, 0) + 1
    return out


@dataclass(frozen=True)
class LocalParallelConfig(ParallelConfig):
    """ParallelConfig whose gather is the stand-in's (the eager reference model's collectives:
    prefill); no process group."""

    def _gather0(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        g = x.new_zeros((self.tp, *x.shape))
        g[0].copy_(x)
        return g


def _standin_engine_class():
    from dspark_compile.runtime.ranks import RankEngine

    class StandinRankEngine(RankEngine):
        """A RankEngine whose programs are rewritten as they are loaded and whose calls are
        run here only (no other rank to send them to)."""
        standin: LocalCollectives = None
        rewritten: dict = None

        def _module(self, program):
            if id(program) not in self._modules:
                counts = rewrite_collectives(program, self.standin, self.pc.tp)
                self.rewritten[program.rel] = counts
            return super()._module(program)

        def _lead(self, name, *args):
            if name is None:
                return args[0](self, *args[1:])
            from dspark_compile.runtime.engine import Engine
            return getattr(Engine, name)(self, *args)

        def stop(self) -> None:
            pass

    return StandinRankEngine


def load_rank_standin(rank_dir, device=None, **options):
    """One rank's engine directory (ENGINE/rank{r} of `build --tp N`, or build_rank_standin's)
    loaded in this process with no process group, every program's collectives replaced by the
    stand-in (module docstring). Returns the engine; `engine.standin` counts the gathers run
    uncaptured, `engine.rewritten` the nodes rewritten per program. `options` as Engine.load's."""
    from dspark_compile.engine_dir.format import MANIFEST
    rank_dir = Path(rank_dir)
    m = json.loads((rank_dir / MANIFEST).read_text())
    tp, rank = m.get("build_config", {}).get("tp"), m.get("tp_rank")
    if not isinstance(tp, int) or tp < 2 or not isinstance(rank, int):
        raise StandinError(f"{rank_dir}/{MANIFEST}: not one rank of a tensor-parallel engine "
                           f"(build_config.tp {tp!r}, tp_rank {rank!r}); pass ENGINE/rank0")
    cls = type("StandinRankEngine", (_standin_engine_class(),),
               {"pc": LocalParallelConfig(rank=rank, tp=tp), "standin": LocalCollectives(),
                "rewritten": {}})
    eng = cls.load(rank_dir, device=device, record_graph_memory=False, **options)
    for runner in eng._modules.values():
        left = count_collectives(runner._program)
        if left:        # a runner built before its rewrite: a bug here, never a silent gather
            raise StandinError(f"program '{runner._program.rel}' kept collectives {left}")
    return eng


# ------------------------------------------------------------------------------------------------
# one rank built in this process (fewer devices than ranks)
# ------------------------------------------------------------------------------------------------

def build_rank_standin(ckpt, out, bc, rank: int = 0, log=print) -> Path:
    """Rank `rank` of `bc.tp`'s engine directory written to `out` (an engine directory as
    ENGINE/rank{r} of `build --tp` holds it: its programs call the functional collectives),
    built in this process under torch.distributed's "fake" process group of bc.tp ranks
    (export traces the collectives; nothing is communicated, and no eager value the build
    computes depends on them). Run it in a fresh process: the group is destroyed after, but
    the build's memory is freed only at exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from dspark_compile.build.pipeline import build_model
    from dspark_compile.models.checkpoint import read_config
    from dspark_compile.models.schema import checkpoint_schema
    from dspark_compile.models.sharding import build_rank_model, check_splits

    if bc.backend != "aten" or bc.tp < 2:
        raise ValueError(f"build_rank_standin: an aten build with tp >= 2 (got --backend "
                         f"{bc.backend}, tp {bc.tp})")
    cfg = read_config(Path(ckpt) / "config.json")
    check_splits(cfg, bc.tp, checkpoint_schema(cfg))
    if dist.is_initialized():
        raise RuntimeError("build_rank_standin: torch.distributed is already initialised here")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=bc.tp)
    # the fake group's gather writes nothing (its output is uninitialised memory), and a CUDA
    # build runs every program once to compile its kernels (build/kernel_compile.py): the
    # stand-in's gather (x then zeros) as the op's CPU and CUDA kernel keeps that run's values
    # finite. Registered for this process only (run the build in a fresh one); the export
    # traces the op's meta kernel, so the programs written are unchanged.
    lib = torch.library.Library("_c10d_functional", "IMPL")
    for key in ("CPU", "CUDA"):
        lib.impl("all_gather_into_tensor", _standin_gather_kernel, key)
    try:
        t0 = time.perf_counter()
        model, read = build_rank_model(ckpt, ParallelConfig.from_group(), bc.precision(),
                                       bc.rope_positions(cfg.dspark_block_size), True,
                                       bc.device)
        log(f"[load] rank {rank} of {bc.tp} (fake process group): "
            f"{read / 2**20:.1f} MiB of the checkpoint read")
        build_model(model, model.full_cfg, ckpt, Path(out), bc, log, None, t0,
                    manifest_fields={"tp_rank": rank})
    finally:
        dist.destroy_process_group()
        lib._destroy()
    return Path(out)


def _standin_gather_kernel(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return LocalCollectives().gather(x, group_size, group_name)
