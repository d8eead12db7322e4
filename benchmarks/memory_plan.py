"""Issue 53's memory question: does DeepSeek-V4-Flash-0731 at TP = 2 fit each target device
with 8 rows x 64k positions? The plan (dspark_compile/build/memory_plan.py) from the config
alone, no GPU and no weights:

    python benchmarks/memory_plan.py --out benchmarks/results/memory_plan

writes flash0731.json (every plan's categories, per device) and flash0731.md (the tables, the
answer per device, the most rows of 64k that fit). Settings are a CUDA build's defaults
(`build --dtype bfloat16`: FP8 activation quant and FP8 KV, prefill chunks auto = 64..512,
target-only programs) with buckets 1, 2, 4, 8 and --max-rows 8.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from dspark_compile.build.memory_plan import (DEVICES, GiB, check_fits, format_plan,
                                              max_rows_that_fit, memory_plan)
from dspark_compile.engine_dir.build_config import BuildConfig
from dspark_compile.factory.presets import preset
from dspark_compile.models.config import ModelConfig

ROWS, SEQ = 8, 65536
TARGETS = ("rtx-pro-6000", "gb10", "h200")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _write(path: Path, text: str) -> None:
    """Atomic: a temporary file in the same directory renamed over `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _fits(plan, device) -> str:
    try:
        check_fits(plan, device)
        return "fits"
    except ValueError as e:
        return str(e)


def _answer(record: dict) -> list[str]:
    """The issue's question answered in one paragraph per rank count."""
    lines = ["**Answer.**"]
    for key, rec in record["plans"].items():
        total = rec["total"] / GiB
        per = "; ".join(f"{name} {d['headroom'] / GiB:+.2f} GiB "
                        f"({'fits' if d['verdict'] == 'fits' else 'does not fit'}, up to "
                        f"{d['max_rows_at_seq_len']} rows of {SEQ:,})"
                        for name, d in rec["devices"].items())
        lines.append(f"- TP = {key[2:]}: each rank needs {total:.2f} GiB "
                     f"(weights {rec['categories']['weights'] / GiB:.2f} GiB). Headroom: {per}.")
    lines.append("- 'Up to N rows' keeps buckets 1-8 (the graph pool of bucket 8) and grows "
                 "max_rows only.")
    return lines


def _notes(cfg, bc) -> list[str]:
    """Where the TP = 2 bytes go, and what would free some, computed here."""
    import dataclasses
    from dspark_compile.models.sharding import rank_weight_bytes
    full, target = rank_weight_bytes(cfg, 1), rank_weight_bytes(cfg, 1, include_draft=False)
    plan = memory_plan(cfg, bc, 2)
    small = memory_plan(cfg, dataclasses.replace(bc, prefill_chunks=(64, 128, 256)), 2)
    table = cfg.qk_rope_head_dim * 4 * bc.rope_positions(cfg.dspark_block_size)
    return [
        "## Notes", "",
        f"- Weights at TP = 1: {full / GiB:.2f} GiB = the target's {target / GiB:.2f} GiB + the "
        f"{cfg.n_mtp_layers}-stage DSpark draft's {(full - target) / GiB:.2f} GiB (each stage "
        f"has its own {cfg.n_routed_experts} MXFP4 experts). The published Flash checkpoint "
        "(148.7 GiB, ../shared/reference/serving_anchors.md) is the target plus one MTP layer: "
        f"{target / GiB:.2f} + {(full - target) / GiB / cfg.n_mtp_layers:.2f} GiB.",
        f"- At TP = 2 the routed experts are {plan.weights['routed experts (MXFP4 + E8M0 per 32)'] / plan.total:.0%} "
        f"of a rank; {plan.replicated_weights / GiB:.2f} GiB of weights are replicated on both "
        "ranks (the latent KV and its compressor / indexer, gates, mHC, norms, Markov head).",
        f"- The decode state is replicated (sharding.py: one latent KV head every query head "
        f"reads): {plan.state_bytes / GiB:.2f} GiB for 9 rows (8 + the trash row), "
        f"{plan.state_bytes / GiB / 9:.3f} GiB a row of 64k. The fp32 compressor rings hold "
        f"max_step_tokens = {plan.max_step_tokens} more entries per row: prefill chunks up to "
        f"256 instead of 512 give {small.state_bytes / GiB:.2f} GiB of state and a "
        f"{small.graph_pool / GiB:.2f} GiB pool ({(plan.total - small.total) / GiB:.2f} GiB less "
        "a rank).",
        f"- The RoPE tables are {plan.rope_tables / GiB:.2f} GiB because the engine's weights file "
        f"holds one {table / 2**20:.1f} MiB table per attention module "
        f"({cfg.num_hidden_layers} + {cfg.n_mtp_layers}, plus rope_main) where two distinct "
        f"tables exist: sharing them on load would free ~{(plan.rope_tables - 4 * table) / GiB:.2f} GiB.",
        "- Estimates: the graph pool (4x the largest program's counted activations; the one "
        "measured pool, tiny fp32 B = 64, is 3.2x the formula) and the workspace (1 GiB CUDA "
        "context and kernels, 0.5 GiB NCCL). Both to be replaced by the load's measured "
        "`graph_pool_bytes` once a two-GPU machine runs Flash.", ""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(preset("flash-0731"))
    bc = BuildConfig(buckets=(1, 2, 4, 8), max_rows=ROWS, max_seq_len=SEQ, dtype="bfloat16",
                     prefill_chunks="auto", target_programs=True)
    commit, date = _git("rev-parse", "HEAD"), datetime.now(timezone.utc).isoformat(
        timespec="seconds")
    record = {"date_utc": date, "git_commit": commit, "config": "flash-0731 preset "
              "(dspark_compile/factory/presets.py)", "max_rows": ROWS, "max_seq_len": SEQ,
              "build": bc.to_manifest(), "plans": {}}
    md = [f"# Flash-0731 memory plan per rank, {ROWS} rows x {SEQ:,} positions",
          "", f"`python benchmarks/memory_plan.py` at {commit[:7]}, {date} (config only: no "
          "GPU, no weights). bf16 compute, FP8 KV, prefill chunks 64..512, buckets 1-8, "
          "target-only programs. Graph pool and workspace are estimates "
          "(dspark_compile/build/memory_plan.py says how); the rest is exact for the current "
          "engine format.", ""]
    for tp in (1, 2):
        plan = memory_plan(cfg, bc, tp)
        rec = {"categories": dict(plan.categories()), "weights": plan.weights,
               "replicated_weights": plan.replicated_weights, "state": plan.state,
               "workspace": plan.workspace, "graph_pool_program": plan.graph_pool_program,
               "total": plan.total, "devices": {}}
        md += [f"## TP = {tp}", "", "```", format_plan(plan), "```", "",
               "| device | usable GiB | source | per-rank total GiB | headroom GiB | verdict | "
               f"most rows of {SEQ:,} that fit |", "|---|---|---|---|---|---|---|"]
        for name in TARGETS:
            dev = DEVICES[name]
            verdict = _fits(plan, dev)
            rows = max_rows_that_fit(cfg, bc, tp, dev)
            rec["devices"][name] = {"total": dev.total, "reserved": dev.reserved,
                                    "usable": dev.usable, "source": dev.source,
                                    "headroom": dev.usable - plan.total, "verdict": verdict,
                                    "max_rows_at_seq_len": rows}
            md.append(f"| {name} | {dev.usable / GiB:.2f} | {dev.source} | {plan.total / GiB:.2f} "
                      f"| {(dev.usable - plan.total) / GiB:+.2f} | "
                      f"{'fits' if verdict == 'fits' else 'does not fit'} | {rows} |")
        # the strict reading of "96 GB": 96e9 bytes (89.41 GiB), in case the card's reported
        # total is lower than nvidia-smi's listing
        strict = 96 * 10**9 - plan.total
        rec["headroom_at_96e9_bytes"] = strict
        md += ["", f"Against 96e9 bytes (89.41 GiB, the strictest reading of \"96 GB\"): "
               f"{strict / GiB:+.2f} GiB.", ""]
        refusals = [d["verdict"] for d in rec["devices"].values() if d["verdict"] != "fits"]
        if refusals:
            md += ["Refusals (the build's own line):", ""] + [f"- {r}" for r in refusals] + [""]
        record["plans"][f"tp{tp}"] = rec
    md[4:4] = _answer(record) + [""]
    md += _notes(cfg, bc)
    _write(out / "flash0731.json", json.dumps(record, indent=1) + "\n")
    _write(out / "flash0731.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
