"""`dspark-compile` command line.

Each subcommand is one function registered in :data:`COMMANDS` with :func:`command`
(dspark_compile/cli/common.py), which also names the function that adds its arguments. `main`
builds the parser from that table, so adding a subcommand touches nothing else:

    def _generate_args(p): p.add_argument(...)

    @command("generate", "generate text with a built engine", _generate_args)
    def cmd_generate(args) -> int: ...

User errors (bad config, bad checkpoint, bad argument values, files that cannot be written)
end the process with exit status 1 and one line on stderr naming the flag, field or file, no
traceback; argparse's own usage errors exit with 2; SIGTERM exits with 143 after the atomic
writers have removed their temporary directories.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dspark_compile.cli import engine_commands  # noqa: F401  (registers generate, build, run, inspect)
from dspark_compile.serve import cli as serve_cli  # noqa: F401  (registers serve)
from dspark_compile.cli import plan_command  # noqa: F401  (registers plan)
from dspark_compile.cli.common import (COMMANDS, PROG, USER_ERRORS, Command, Terminated,  # noqa: F401
                                       command, device, path_arg, sigterm_raises, to_flags)
from dspark_compile.build.checks import writable_sibling
from dspark_compile.engine_dir.versions import package_version, triton_version
from dspark_compile.factory.synth import synth_checkpoint

# One intra-op thread per process unless --threads says otherwise: the CLI often runs as one
# of several processes on a shared machine (tests, benchmarks, engines side by side), and under
# such load `generate` ran 2.8x slower with torch's default (a thread per core in every
# process, all contending for the same cores) than with one thread per process.
DEFAULT_THREADS = 1


def max_threads() -> int:
    """--threads' bound: the CPUs of this machine (os.cpu_count()). More intra-op threads than
    CPUs only contend for them, and far more crash the process: torch's OpenMP runtime
    (libgomp) sets up a parallel region's threads on its own stack, so --threads 100000
    segfaulted (exit 139) at the first parallel op, and 20000 aborted ("Thread creation
    failed") on a 2-CPU machine."""
    import os
    return os.cpu_count() or 1

# ---- synth ---------------------------------------------------------------------------------

# flash-0731 (167 GB) is left out on purpose: nothing here needs a full-size random checkpoint.
SYNTH_PRESETS = ("tiny", "tiny-trained", "tiny-deep", "flash-slice")


def _synth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", required=True, choices=SYNTH_PRESETS,
                   help="built-in configuration (flash-slice writes ~24 GB)")
    p.add_argument("--out", required=True, type=path_arg,
                   help="output directory (created atomically)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed, a 64-bit signed int like run's --seed (default 0)")
    p.add_argument("--shard-size", type=float, default=None, metavar="MB",
                   help="shard the safetensors at this many MB (default: one file up to 4 GiB)")
    p.add_argument("--device", default="cpu",
                   help="device that generates the values (e.g. cuda for flash-slice; default cpu)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out that holds a checkpoint (config.json + "
                        "safetensors only, no subdirectory)")


# --shard-size's bound: a shard holds at least one byte, and the byte count must be an int the
# writer can compare (1e308 MB is inf bytes, which int() cannot convert)
MAX_SHARD_MB = float(1 << 40)          # 2^60 bytes: beyond any disk


def _shard_bytes(mb: float) -> int:
    """--shard-size MB -> bytes: a finite number in [1 byte, MAX_SHARD_MB], else one line."""
    if not 1 / (1 << 20) <= mb <= MAX_SHARD_MB:       # NaN fails too
        raise ValueError(f"--shard-size must be a positive number of MB, from "
                         f"{1 / (1 << 20):.3g} (one byte) to {MAX_SHARD_MB:.0f}, got {mb}")
    return int(mb * (1 << 20))


@command("synth", "write a synthetic DeepSeek-V4 + DSpark checkpoint", _synth_args,
         flags={"overwrite=True": "--overwrite", "shard_size_bytes": "--shard-size"})
def cmd_synth(args: argparse.Namespace) -> int:

    if not -(1 << 63) <= args.seed < (1 << 63):
        raise ValueError(f"--seed must fit in 64 bits (a signed int64, as run's --seed), got "
                         f"{args.seed}")
    out = Path(args.out)
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    writable_sibling(out, "--out")
    dev = device(args.device)
    shard = None
    if args.shard_size is not None:
        shard = _shard_bytes(args.shard_size)
    out = synth_checkpoint(args.preset, args.out, seed=args.seed, shard_size_bytes=shard,
                           device=dev, overwrite=args.overwrite)
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {args.preset} checkpoint (seed {args.seed}) to {out}: {', '.join(files)}")
    return 0


# ---- entry point ---------------------------------------------------------------------------

def _threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    if n > max_threads():
        raise argparse.ArgumentTypeError(f"must be <= {max_threads()} (os.cpu_count(), the CPUs "
                                         f"of this machine), got {n}")
    return n


def _version() -> str:
    import torch

    return (f"{PROG} {package_version()} (torch {torch.__version__}, "
            f"triton {triton_version() or 'not installed'})")


class _VersionAction(argparse.Action):
    """--version, with the versions read only when asked (importing torch takes seconds)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Ahead-of-time compiler for "
                                     "DeepSeek-V4 speculative decoding with the DSpark draft.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the dspark-compile, torch and triton versions and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.add_argument("--threads", type=_threads, default=DEFAULT_THREADS, metavar="N",
                       help=f"torch CPU threads, 1 to the CPU count ({max_threads()} here; "
                            f"default {DEFAULT_THREADS}: one per process)")
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    import torch

    args = build_parser().parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with sigterm_raises():
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{PROG} {args.command}: terminated", file=sys.stderr)
        return 143
    except USER_ERRORS as e:
        msg = to_flags(str(e), COMMANDS[args.command].flags)
        print(f"{PROG} {args.command}: error: {msg}".replace("\n", " "), file=sys.stderr)
        return 1
    finally:
        # an in-process caller (tests, notebooks) keeps its own thread count
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
