"""`plan`: each rank's memory for a checkpoint's config and build settings, before anything is
loaded (build/memory_plan.py); exit status 1 with one line when it does not fit the device.

    dspark-compile plan CKPT --tp 2 --max-rows 8 --max-seq-len 65536 --target-device rtx-pro-6000
    dspark-compile plan --preset flash-0731 --tp 2 --max-rows 8 --max-seq-len 65536 --device-memory-gib 96

Only config.json is read (a directory holding it, or the file itself), so the plan of a
150 GB checkpoint takes a second on any machine.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark_compile.build.memory_plan import (DEVICES, check_fits, device_memory, format_plan,
                                              memory_plan)
from dspark_compile.cli.common import command, int_arg, path_arg, prefill_chunks_arg
from dspark_compile.engine_dir.build_config import DEFAULT_BUCKETS, DTYPES, BuildConfig


def _ints(text: str) -> tuple:
    try:
        out = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    return out


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", type=path_arg, default=None,
                   help="checkpoint directory (or its config.json); only config.json is read")
    p.add_argument("--preset", default=None,
                   help="a built-in config instead of a checkpoint (e.g. flash-0731)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (default 1)")
    p.add_argument("--max-rows", type=int_arg(1), default=None,
                   help="concurrent requests (default: the largest bucket)")
    p.add_argument("--max-seq-len", type=int_arg(1), default=1024,
                   help="positions per request (default 1024)")
    p.add_argument("--buckets", type=_ints, default=None,
                   help="batch buckets (default: build's, up to --max-rows when given)")
    p.add_argument("--prefill-chunks", type=prefill_chunks_arg, default="auto",
                   metavar="C1,C2|auto|none",
                   help="prefill program chunk lengths (default auto, as build)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="compute dtype (default bfloat16, a CUDA build's)")
    p.add_argument("--no-kv-fp8", action="store_true", help="KV caches in the compute dtype")
    p.add_argument("--no-target-programs", action="store_true",
                   help="no target-only programs (as build --no-target-programs)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target-device", choices=sorted(DEVICES), default=None,
                        help="check the plan against this device's memory")
    target.add_argument("--device-memory-gib", type=float, default=None, metavar="GIB",
                        help="check the plan against a device of this many GiB")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _config(args):
    from dspark_compile.models.checkpoint import CheckpointError, missing_dir, read_config
    from dspark_compile.models.config import ModelConfig
    if (args.checkpoint is None) == (args.preset is None):
        raise ValueError("plan: give a checkpoint directory or --preset (one of them)")
    if args.preset is not None:
        from dspark_compile.factory.presets import preset
        return ModelConfig.from_dict(preset(args.preset))
    path = Path(args.checkpoint)
    if path.is_dir():
        path = path / "config.json"
    elif not path.is_file():
        raise CheckpointError(missing_dir(path))
    return read_config(path)


def _check_positions(cfg, max_seq_len: int) -> None:
    """The positions build accepts (build/checks.py check_build): room for a 1-token prompt, 1
    new token and the draft block's lookahead, and no more than the model was built for."""
    from dspark_compile.models.config import request_positions
    least = request_positions(1, 1, cfg.dspark_block_size)
    if max_seq_len < least:
        raise ValueError(f"max_seq_len must be >= {least} (a 1-token prompt, 1 new token and the "
                         f"draft block's lookahead), got {max_seq_len}")
    if max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings} (config.json)")


@command("plan", "each rank's memory for a checkpoint and build settings (nothing loaded)",
         _plan_args, flags={"max_rows": "--max-rows", "max_seq_len": "--max-seq-len",
                            "buckets": "--buckets", "prefill_chunks": "--prefill-chunks",
                            "tp": "--tp"})
def cmd_plan(args) -> int:
    cfg = _config(args)
    _check_positions(cfg, args.max_seq_len)
    buckets = args.buckets
    if buckets is None:
        buckets = DEFAULT_BUCKETS if args.max_rows is None else \
            tuple(b for b in DEFAULT_BUCKETS if b <= args.max_rows) or (args.max_rows,)
    bc = BuildConfig(buckets=buckets, max_rows=args.max_rows or 0, max_seq_len=args.max_seq_len,
                     prefill_chunks=args.prefill_chunks, dtype=args.dtype,
                     kv_fp8=not args.no_kv_fp8, target_programs=not args.no_target_programs)
    plan = memory_plan(cfg, bc, args.tp)
    device = device_memory(args.target_device, args.device_memory_gib)
    if args.json:
        out = {"tp": plan.tp, "max_rows": plan.max_rows, "max_seq_len": plan.max_seq_len,
               "categories": dict(plan.categories()), "weights": plan.weights,
               "state": plan.state, "workspace": plan.workspace, "total": plan.total,
               "device": None if device is None else {"name": device.name,
                                                      "usable": device.usable}}
        print(json.dumps(out, indent=1))
    else:
        print(format_plan(plan, device), flush=True)
    if device is not None:
        check_fits(plan, device)
    return 0
