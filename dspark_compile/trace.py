"""Build: export the draft-plus-verify step once per batch bucket, run the passes, write the engine.

    checkpoint ──load──► reference model ──torch.export (non-strict)──► one program per bucket
               ──PassManager (cleanup → fusions → lint)──► save_engine (atomic)

The program's inputs are `(rows, state)`: `rows` [B] maps batch rows to state rows (the trash
row for padding) and `state` is the dict of preallocated decode-state tensors, updated in place
(the program runs on the IR as exported: `run_decompositions()` would functionalise every cache
update into a whole-cache copy, DESIGN §8). Shapes are static per bucket.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from dspark_compile.artifact import MANIFEST, save_engine

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


@dataclass
class BuildConfig:
    """Everything that decides what the engine computes (recorded in the manifest)."""
    buckets: tuple = DEFAULT_BUCKETS
    max_rows: int = 0               # concurrent request rows; 0 = the largest bucket
    max_seq_len: int = 1024         # positions per request (prompt + generated + one block)
    prefill_chunk: int = 64         # tokens per eager prefill forward
    dtype: str = "float32"          # compute dtype of activations
    act_quant: bool = True          # simulate FP8 activation quant at FP8 GEMMs
    kv_fp8: bool = True             # FP8 (fp8_ds_mla-style) KV caches
    passes: tuple | None = None     # None = the default pipeline
    disabled_passes: tuple = ()
    verify_passes: bool = False
    dump_dir: str | None = None
    arch: str | None = None         # e.g. "sm_120": store that arch's kernel resource report
    device: str = "cpu"

    def __post_init__(self):
        self.buckets = tuple(sorted(set(int(b) for b in self.buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive integers, got {self.buckets}")
        if self.max_rows == 0:
            self.max_rows = self.buckets[-1]
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    def precision(self):
        from dspark_compile.models.config import Precision
        return Precision(dtype=DTYPES[self.dtype], act_quant=self.act_quant, kv_fp8=self.kv_fp8)

    def cache(self, block: int):
        from dspark_compile.models.config import CacheConfig
        return CacheConfig(max_rows=self.max_rows, max_seq_len=self.max_seq_len,
                           max_step_tokens=max(self.prefill_chunk, block + 1))

    def to_manifest(self) -> dict:
        d = asdict(self)
        d.pop("dump_dir")
        d.pop("verify_passes")
        return d


def export_step(model, state: dict, bucket: int) -> torch.export.ExportedProgram:
    """One static program for `bucket` request rows.

    Node meta is preserved during tracing so that each call of a `@fusable` reference function
    (kernels/region.py) lands in the graph as an annotated region the fusion passes replace."""
    from dspark_compile.models.step import DraftVerifyStep
    step = DraftVerifyStep(model)
    with torch.no_grad(), torch.fx.traceback.preserve_node_meta():
        return torch.export.export(step, (torch.arange(bucket, device=state["row.last_pos"].device), state), strict=False)


def prefilled_state(model, cache, bucket: int, seed: int):
    """A realistic state for `bucket` rows: random prompts prefilled, mixed sampling settings,
    the last row of a multi-row bucket left as padding. Used to verify passes numerically."""
    from dspark_compile.models.generate import SamplingParams, set_row_sampling
    from dspark_compile.models.state import allocate_state, trash_row
    from dspark_compile.models.step import prefill

    rng = random.Random(seed)
    device = next(model.buffers()).device
    state = allocate_state(model.cfg, cache, model.prec, device)
    live = bucket - 1 if bucket > 1 else 1
    for r in range(live):
        sp = SamplingParams(temperature=rng.choice([0.0, 0.0, 0.8, 1.0]), top_k=rng.choice([0, 5]),
                            top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1 << 30))
        set_row_sampling(state, r, sp)
        prompt = [rng.randrange(model.cfg.vocab_size) for _ in range(rng.randint(1, 12))]
        prefill(model, state, r, prompt, cache.max_step_tokens, speculative=True)
    rows = torch.tensor([r if r < live else trash_row(state) for r in range(bucket)], device=device)
    return rows, state


def state_input_names(ep) -> list[str]:
    """User-input names of the program that are state tensors (everything but `rows`)."""
    return [n for n in ep.graph_signature.user_inputs][1:]


def build_engine(ckpt: str | Path, out: str | Path, bc: BuildConfig,
                 log: Callable[[str], None] = print) -> dict:
    from dspark_compile.models import load_model
    from dspark_compile.models.checkpoint import load_checkpoint
    from dspark_compile.models.state import allocate_state
    from dspark_compile.passes import PassConfig, PassManager

    out = Path(out)
    if out.exists() and (not out.is_dir()
                         or (any(out.iterdir()) and not (out / MANIFEST).exists())):
        # save_engine refuses too, but only after every bucket has been exported
        raise ValueError(f"output {out} exists and is not an engine directory (no {MANIFEST}); "
                         "refusing to replace it")
    t0 = time.perf_counter()
    log(f"[load] checkpoint {ckpt}")
    cfg, tensors = load_checkpoint(ckpt, device=bc.device)   # names a missing/bad checkpoint
    raw_config = json.loads((Path(ckpt) / "config.json").read_text())
    if not cfg.has_draft:
        raise ValueError("config field 'dspark_block_size': the checkpoint has no DSpark draft; "
                         "the engine compiles the draft-plus-verify step")
    prec = bc.precision()
    model = load_model(None, prec, bc.max_seq_len + cfg.dspark_block_size + 2, True, bc.device,
                       tensors=tensors, cfg=cfg)
    del tensors
    cache = bc.cache(cfg.dspark_block_size)
    log(f"[load] done in {time.perf_counter() - t0:.1f}s")

    pconf = PassConfig(disabled=frozenset(bc.disabled_passes), verify=bc.verify_passes,
                       dump_dir=bc.dump_dir, target_device=bc.device)
    programs, stats = {}, {}
    pm = None
    for b in sorted(bc.buckets, reverse=True):
        t = time.perf_counter()
        state = allocate_state(cfg, cache, prec, bc.device)
        ep = export_step(model, state, b)
        log(f"[export] bucket {b}: {len(ep.graph.nodes)} nodes in {time.perf_counter() - t:.1f}s")
        pm = PassManager(bc.passes, pconf)
        factory = None
        if bc.verify_passes:
            def factory(seed, b=b):
                return tuple(pytree.tree_flatten(prefilled_state(model, cache, b, seed))[0])
        rows = pm.run(ep, input_factory=factory, state_inputs=state_input_names(ep))
        for r in rows:
            log(f"[pass] bucket {b}: {r['name']:<28} {r['time_ms']:>9.1f} ms  nodes "
                f"{r['nodes_before']:>6} -> {r['nodes_after']:<6} matches {r['matches']}"
                + ("  verified" if r.get("verified") else ""))
        # export keeps the example inputs (here: the whole decode state, ~100 MB even for the
        # tiny model) and torch.export.save would write them into every program file; the
        # runtime allocates its own state, so they are dropped
        ep.example_inputs = None
        programs[b], stats[str(b)] = ep, rows

    extra = {}
    if bc.arch:
        from dspark_compile.kernels.sm12x import resource_report
        report = resource_report(bc.arch)
        extra[f"kernels/{bc.arch}/resources.json"] = json.dumps(report, indent=1)
    fields = {
        "model_config": raw_config,
        "build_config": bc.to_manifest(),
        "passes": pm.manifest_entries(),
        "pass_config_hash": pconf.hash(),
        "pass_stats": stats,
    }
    if bc.arch:
        fields["kernel_resources"] = {bc.arch: report}
    t = time.perf_counter()
    manifest = save_engine(out, programs, manifest_fields=fields, extra_files=extra)
    log(f"[write] {out} in {time.perf_counter() - t:.1f}s (total {time.perf_counter() - t0:.1f}s)")
    log(pm.format_stats(stats[str(max(bc.buckets))]))
    return manifest
