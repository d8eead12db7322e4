"""Tensor-parallel engines at run time: one rank's engine, and the ranks started together.

An engine built with `build --tp N` (dspark_compile/build/tp_build.py) is ranks.json plus one
engine directory per rank. `load_rank(dir, rank, tp)` checks ranks.json (the rank count, the
rank's manifest hash) and loads rank{r}/ as a `RankEngine`: the plain Engine (programs, shared
weights = the rank's shard, decode state, which is whole on every rank) whose eager reference
model is the rank's ParallelDeepseekV4 (models/sharding.py), and whose programs' collectives
name a process group that this process has, of N ranks (checked at load).

`run_ranks(dir, tp, fn, ...)` starts the N ranks itself (torch.multiprocessing spawn; gloo on
the CPU, NCCL with rank r on cuda:r), each loading its engine and calling `fn(engine, rank,
...)`. Rank 0 holds the scheduler: it drives its RankEngine like any Engine (generate, streams,
run_step), and each call that runs a program or writes the decode state (launch, prefill,
launch_prefill, set_row_sampling, prompt_logprobs, and `run_everywhere(fn, ...)` for an eager
reference) is first broadcast to the other ranks — the call's name and its small arguments
(rows, ProgramKey, prompt, sampling parameters; torch.distributed.broadcast_object_list, a
few hundred bytes) — which run it in `follow()` until rank 0's `stop()`. Every rank so
executes the same programs on the same state in the same order; their outputs are bitwise the
same on every rank (the reductions add gathered operands in rank order, models/parallel.py; the
samplers draw with the same Philox keys). A rank that dies ends the others (spawn terminates
them; a rank blocked in a collective with a dead peer gets gloo's connection error) and
`run_ranks` raises one RanksFailed naming it.
"""
from __future__ import annotations

import hashlib
import json
import re
import socket
import sys
from pathlib import Path

import torch

from dspark_compile.engine_dir.format import MANIFEST, ArtifactError
from dspark_compile.engine_dir.graph_format import COLLECTIVES
from dspark_compile.engine_dir.load import MAX_MANIFEST_BYTES
from dspark_compile.engine_dir.paths import read_file
from dspark_compile.engine_dir.tp_format import RANKS_FILE, check_tp, rank_dir, read_ranks
from dspark_compile.runtime.engine import Engine

_STOP = "stop"


# ---- the ranks as processes ---------------------------------------------------------------

class RanksFailed(ChildProcessError):
    """A rank raised or died; the others were ended (the CLI reports it in one line)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_ranks(ctx, what: str) -> None:
    """Wait for every rank; a rank that raised or died ends the others (torch.multiprocessing
    kills them) and becomes one RanksFailed naming the rank and its error line."""
    import torch.multiprocessing as mp
    try:
        while not ctx.join():
            pass
    except mp.ProcessRaisedException as e:
        raise RanksFailed(f"{what} --tp: rank {e.error_index} failed: "
                           f"{error_line(str(e))}") from None
    except mp.ProcessExitedException as e:
        raise RanksFailed(f"{what} --tp: rank {e.error_index} died (exit code "
                          f"{e.exit_code}); the other ranks were ended") from None


def error_line(text: str) -> str:
    """The exception line of a rank's traceback (its last "SomethingError: ..." line, torch's
    own notes after it skipped), else its last line."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if _ERROR_LINE.match(ln)]
    return (errors or lines or [""])[-1].strip()


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Refused|Interrupt)\b.*:")


def init_rank(rank: int, tp: int, port: int, device: str, threads: int = 1) -> str:
    """This process's torch.distributed group of the tp ranks on loopback (gloo on the CPU;
    NCCL with rank r on cuda:r) and its intra-op `threads` (the spawning process's count: the
    CLI's --threads, default 1; a spawned process would start at one per core); returns the
    device."""
    import torch.distributed as dist
    torch.set_num_threads(threads)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=tp)
    return device


# ---- one rank's engine -------------------------------------------------------------------

class RankEngine(Engine):
    """One rank's Engine (module docstring). `pc` (models/parallel.py ParallelConfig) is set
    on the class load_rank makes, before Engine.__init__ builds the reference model. Rank 0
    drives it like any Engine and each call that runs a program is sent to the others, which
    run `follow()` until rank 0's `stop()`."""
    pc = None
    _depth = 0          # > 0 inside a call already sent (or being followed)

    def _reference_model(self, weights: dict):
        """The rank's ParallelDeepseekV4 over the engine's shard (no copy): every buffer whose
        shape the shard decides (a vocab or intermediate split, the experts in their kernel
        layout, the gate at all experts) taken as the shard holds it."""
        from dspark_compile.models.config import rope_positions
        from dspark_compile.models.moe import sync_kernel_layouts
        from dspark_compile.models.sharding import ParallelDeepseekV4

        with torch.device(self.device):
            model = ParallelDeepseekV4(self.cfg, self.pc, self.build.precision(),
                                       rope_positions(self.build.max_seq_len,
                                                      self.cfg.dspark_block_size))
        sd = {k[len("model."):]: v for k, v in weights.items() if k.startswith("model.")}
        persistent = set(model.state_dict())
        for name, buf in list(model.named_buffers()):
            t = sd.get(name)
            if name in persistent and t is not None and t.shape != buf.shape:
                # shaped by the shard (the layout of Engine._reference_model's tiled experts)
                mod, _, attr = name.rpartition(".")
                setattr(model.get_submodule(mod), attr,
                        torch.empty(t.shape, dtype=t.dtype, device="meta"))
        missing, unexpected = model.load_state_dict(
            {k: v for k, v in sd.items() if k in persistent}, strict=False, assign=True)
        unexpected += [k for k in sd if k not in persistent
                       and k not in dict(model.named_buffers(remove_duplicate=False))]
        if missing or unexpected:
            raise ValueError(f"rank {self.pc.rank}'s engine weights do not fit its model: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        sync_kernel_layouts(model)
        return model.eval()

    # ---- rank 0 leads, the others follow (module docstring) --------------------------------
    # the Engine calls that run a program or the eager model, or write the decode state: the
    # scheduler reaches the engine through these (and has / times / read-only checks)
    def launch(self, rows, key, use_graph: bool = True, logprobs: bool = False):
        return self._lead("launch", [int(r) for r in rows], key, use_graph, logprobs)

    def set_row_sampling(self, row: int, params) -> None:
        return self._lead("set_row_sampling", row, params)

    def prefill(self, row: int, prompt: list[int]) -> int:
        return self._lead("prefill", row, list(prompt))

    def launch_prefill(self, row: int, prompt: list[int], calls: list, logprobs: bool = False):
        return self._lead("launch_prefill", row, list(prompt), list(calls), logprobs)

    def prompt_logprobs(self, row: int, prompt: list[int], k: int) -> list:
        return self._lead("prompt_logprobs", row, list(prompt), k)

    def run_everywhere(self, fn, *args):
        """`fn(engine, *args)` on every rank (a module-level function: rank 0 sends it by
        name), e.g. an eager reference decoding whose collectives need every rank; rank 0's
        result."""
        return self._lead(None, fn, *args)

    def _lead(self, name, *args):
        """Rank 0: send the call to the others (unless it is inside a call already sent: the
        base method's own calls of these methods run on every rank anyway), then run it."""
        import torch.distributed as dist
        if self.pc.rank == 0 and not self._depth:
            dist.broadcast_object_list([(name, args)], src=0)
        self._depth += 1
        try:
            if name is None:
                return args[0](self, *args[1:])
            return getattr(Engine, name)(self, *args)
        finally:
            self._depth -= 1

    def follow(self) -> None:
        """Another rank's loop: run rank 0's calls, in its order, until it stops."""
        import torch.distributed as dist
        if self.pc.rank == 0:
            raise RuntimeError("rank 0 leads: it does not follow")
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            name, args = box[0]
            if name == _STOP:
                return
            self._lead(name, *args)

    def stop(self) -> None:
        """Rank 0: end the others' follow() loops."""
        import torch.distributed as dist
        if self.pc.rank == 0:
            dist.broadcast_object_list([(_STOP, ())], src=0)


def check_groups(eng: Engine, tp: int) -> None:
    """Every collective of the engine's loaded programs names a process group of this process
    with `tp` ranks (graph_format.COLLECTIVES: the name is the program's string literal)."""
    from torch._C._distributed_c10d import _resolve_process_group
    seen = set()
    for runner in eng._modules.values():
        program = runner._program
        for name, op, args, _ in program.nodes:
            full = f"{op._schema.name.replace('::', '.')}.{op._overloadname}" \
                if isinstance(op, torch._ops.OpOverload) else ""
            pos = COLLECTIVES.get(full)
            if pos is None or args[pos] in seen:
                continue
            try:
                size = _resolve_process_group(args[pos]).size()
            except Exception:  # noqa: BLE001 -- c10d's lookup error
                size = None
            if size != tp or args[pos - 1] != tp:
                raise ArtifactError(f"program '{program.rel}': node '{name}' gathers over the "
                                    f"process group {args[pos]!r} of {args[pos - 1]} ranks; "
                                    f"this process has " + (f"that group with {size} ranks"
                                                            if size else "no such group"),
                                    path=program.rel)
            seen.add(args[pos])


def load_rank(engine_dir, rank: int, tp: int, device=None, **options) -> RankEngine:
    """Rank `rank`'s engine of the tensor-parallel engine at `engine_dir` (torch.distributed
    initialised with `tp` ranks: init_rank); `options` as Engine.load's."""
    import torch.distributed as dist
    from dspark_compile.models.parallel import ParallelConfig

    root = Path(engine_dir)
    check_tp(root, tp)
    doc = read_ranks(root)
    sub = root / rank_dir(rank)
    # through the engine's checked reader: a rank directory or manifest that is a link (to
    # outside the engine) is refused, not followed
    data = read_file(root, f"{rank_dir(rank)}/{MANIFEST}", MAX_MANIFEST_BYTES)
    if hashlib.sha256(data).hexdigest() != doc["ranks"][rank]["manifest_sha256"]:
        raise ArtifactError(f"{sub}/{MANIFEST} is not the manifest {RANKS_FILE} lists for rank "
                            f"{rank} (changed since the build?) — rebuild", path=str(sub))
    m = json.loads(data)
    if m.get("build_config", {}).get("tp") != tp or m.get("tp_rank") != rank:
        raise ArtifactError(f"{sub}/{MANIFEST} is not rank {rank} of {tp} (build_config.tp "
                            f"{m.get('build_config', {}).get('tp')}, tp_rank {m.get('tp_rank')})",
                            path=str(sub))
    # the directory's checks above need no process group (tests make them in-process)
    if not dist.is_initialized() or dist.get_world_size() != tp or dist.get_rank() != rank:
        raise ValueError(f"load_rank: torch.distributed must be initialised as rank {rank} of "
                         f"{tp} (init_rank)")
    cls = type("RankEngine", (RankEngine,), {"pc": ParallelConfig.from_group()})
    # the load records nothing in the rank's manifest: ranks.json pins its hash
    eng = cls.load(sub, device=device, record_graph_memory=False, **options)
    check_groups(eng, tp)
    return eng


def run_ranks(engine_dir, tp: int, fn, args: tuple = (), device: str = "cpu",
              load_options: dict | None = None, what: str = "run",
              grace_s: float = 60.0) -> None:
    """Start `tp` ranks (spawned processes), each loading its engine and calling
    `fn(engine, rank, *args)` (a module-level function); returns when all have returned. A rank
    that raises or dies ends the others: one RanksFailed naming it ("`what` --tp: rank r ...").
    Each rank runs this process's intra-op thread count. When this process is interrupted
    (cli/common.py's Terminated on SIGTERM, KeyboardInterrupt), rank 0 gets SIGTERM (a
    server drains) and `grace_s` to end, then every rank left is killed; the exception goes
    on."""
    import torch.multiprocessing as mp
    check_tp(engine_dir, tp)
    ctx = mp.spawn(_rank_main, args=(tp, free_port(), str(engine_dir), device, fn, args,
                                     load_options or {}, torch.get_num_threads()),
                   nprocs=tp, join=False)
    try:
        join_ranks(ctx, what)
    except RanksFailed:
        raise
    except BaseException:
        end_ranks(ctx.processes, grace_s)
        raise


def end_ranks(procs, grace_s: float) -> None:
    """SIGTERM to rank 0 (it stops the others' follow() loops), `grace_s` for all to end, then
    SIGKILL to any left."""
    import os
    import signal
    import time
    if procs[0].is_alive():
        os.kill(procs[0].pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _rank_main(rank, tp, port, engine_dir, device, fn, args, load_options, threads) -> None:
    import torch.distributed as dist
    device = init_rank(rank, tp, port, device, threads)
    try:
        eng = load_rank(engine_dir, rank, tp, device=device, **load_options)
        fn(eng, rank, *args)
    finally:
        sys.stdout.flush()
        dist.destroy_process_group()
