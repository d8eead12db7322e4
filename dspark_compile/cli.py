"""`dspark-compile` command line.

Each subcommand is one function registered in :data:`COMMANDS` with :func:`command`, which
also names the function that adds its arguments. `main` builds the parser from that table, so
adding a subcommand touches nothing else:

    def _generate_args(p): p.add_argument(...)

    @command("generate", "generate text with a built engine", _generate_args)
    def cmd_generate(args) -> int: ...

User errors (bad config, bad checkpoint, bad argument values, files that cannot be written)
end the process with exit status 1 and one line on stderr, no traceback; argparse's own usage
errors exit with 2.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

PROG = "dspark-compile"


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Register the decorated `fn(args) -> exit status` as subcommand `name`."""

    def deco(fn: Callable[[argparse.Namespace], int]):
        if name in COMMANDS:
            raise RuntimeError(f"subcommand {name!r} registered twice")
        COMMANDS[name] = Command(name, help, add_arguments, fn)
        return fn

    return deco


# Bad input, reported as one line. ConfigError and CheckpointError are ValueErrors; OSError
# covers paths that cannot be read or written. Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


# ---- synth ---------------------------------------------------------------------------------

# flash-0731 (167 GB) is left out on purpose: nothing here needs a full-size random checkpoint.
SYNTH_PRESETS = ("tiny", "flash-slice")

def _synth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", required=True, choices=SYNTH_PRESETS,
                   help="built-in configuration (flash-slice writes ~24 GB)")
    p.add_argument("--out", required=True, help="output directory (created atomically)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--shard-size", type=float, default=None, metavar="MB",
                   help="shard the safetensors at this many MB (default: one file up to 4 GiB)")
    p.add_argument("--device", default="cpu",
                   help="device that generates the values (e.g. cuda for flash-slice; default cpu)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")


@command("synth", "write a synthetic DeepSeek-V4 + DSpark checkpoint", _synth_args)
def cmd_synth(args: argparse.Namespace) -> int:
    from dspark_compile.models.synth import synth_checkpoint

    device = _device(args.device)
    shard = None
    if args.shard_size is not None:
        if not args.shard_size > 0:
            raise ValueError(f"--shard-size must be a positive number of MB, got {args.shard_size}")
        shard = int(args.shard_size * (1 << 20))
    out = synth_checkpoint(args.preset, args.out, seed=args.seed, shard_size_bytes=shard,
                           device=device, overwrite=args.overwrite)
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {args.preset} checkpoint (seed {args.seed}) to {out}: {', '.join(files)}")
    return 0


def _device(name: str):
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: CUDA is not available on this machine")
    return dev


# ---- entry point ---------------------------------------------------------------------------

from dspark_compile import cli_engine  # noqa: E402,F401  (registers generate, build, run, inspect)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Ahead-of-time compiler for "
                                     "DeepSeek-V4 speculative decoding with the DSpark draft.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"{PROG} {args.command}: error: {e}".replace("\n", " "), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
