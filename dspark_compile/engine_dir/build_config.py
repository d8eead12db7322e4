"""The build's configuration: everything that decides what an engine computes.

The builder (dspark_compile/build/pipeline.py) consumes it and the manifest records it; the runtime
(dspark_compile/runtime/engine.py) rebuilds it from the manifest to size the decode state and the eager
prefill model. It lives apart from the builder so the runtime does not import the builder.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from dspark_compile.engine_dir.format import BACKENDS
from dspark_compile.models.config import CacheConfig, Precision, rope_positions

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
# BuildConfig fields the manifest leaves out: they change how a build runs, not what the engine
# computes
NOT_RECORDED = ("dump_dir", "verify_passes", "compile_workers", "overwrite")


@dataclass
class BuildConfig:
    """Everything that decides what the engine computes (recorded in the manifest)."""
    buckets: tuple = DEFAULT_BUCKETS
    max_rows: int = 0               # concurrent request rows; 0 = the largest bucket
    max_seq_len: int = 1024         # positions per request (models/config.py request_positions)
    prefill_chunk: int = 64         # tokens per eager prefill forward
    # chunk lengths with a prefill program each (models/prefill_chunk.py); () = none, the
    # runtime prefills with the eager reference; "auto" = default_prefill_chunks(max_seq_len)
    # (the CLI's default)
    prefill_chunks: tuple | str = ()
    # a target-only program per bucket (models/step.py TargetStep): the engine's own
    # non-speculative decoding, which `run --no-speculation` runs and `run --check-lossless`
    # compares the speculative output with; ~half a step's export each (the CLI's default: on)
    target_programs: bool = False
    # one step program (and one target-only program) for every bucket, exported with a dynamic
    # batch size B in [1, max_rows], and one prefill program for every chunk length
    # (build/pipeline.py): export, passes, storage and load stop growing with the bucket count;
    # each bucket still captures its own CUDA graph. False (build --static-batch): one program
    # per size. The Inductor backend compiles one program per shape either way, so it exports
    # per size (__post_init__)
    dynamic_batch: bool = True
    dtype: str = "float32"          # compute dtype of activations
    act_quant: bool = True          # simulate FP8 activation quant at FP8 GEMMs
    kv_fp8: bool = True             # FP8 (fp8_ds_mla-style) KV caches
    passes: tuple | None = None     # None = the default pipeline
    disabled_passes: tuple = ()
    verify_passes: bool = False
    dump_dir: str | None = None
    arch: str | None = None         # e.g. "sm_120": store that arch's kernel resource report
    device: str = "cpu"
    # "inductor": the glue between the dspark:: ops compiled by Inductor at build time
    # (dspark_compile/build/inductor.py); "aten": the exported program runs op by op. "" = aten on
    # every device: on the H200 machine the Inductor build of one tiny-model step program had
    # not finished after 465 s (a build compiles two per bucket), while the aten engine builds
    # in minutes and runs the tiny step in 2.5 ms at B = 1 (README, "Command line")
    backend: str = ""
    # worker processes compiling side by side: a CUDA build's Triton kernels
    # (dspark_compile/build/kernel_pool.py; 0 = one per core, bounded by memory) and the
    # Inductor backend's programs (build/compile_workers.py; 0 = one per program up to half the
    # cores); 1 = in the building process
    compile_workers: int = 0
    # replace an engine already at the output (never a directory holding other files); False
    # (the CLI without --overwrite): an output that is not absent or empty is refused, also one
    # that appears while the build runs (dspark_compile/engine_dir/write.py save_engine)
    overwrite: bool = True
    # tensor-parallel ranks (build --tp): each rank's programs and weight shard in rank{r}/ of
    # the engine directory (dspark_compile/build/tp_build.py; models/sharding.py the split); a
    # power of two that divides the split shapes; 1: one device, the plain engine
    tp: int = 1

    def __post_init__(self):
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1 \
                or self.tp & (self.tp - 1):
            raise ValueError(f"tp must be a power of two >= 1 (ranks), got {self.tp!r}")
        if not self.backend:
            self.backend = "aten"
        if self.backend == "inductor":
            self.dynamic_batch = False
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.compile_workers < 0:
            raise ValueError(f"compile_workers must be >= 0, got {self.compile_workers}")
        self.buckets = tuple(sorted(set(int(b) for b in self.buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive integers, got {self.buckets}")
        if self.max_rows == 0:
            self.max_rows = self.buckets[-1]
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")
        if self.max_rows < self.buckets[-1]:
            # a bucket's program runs that many state rows at once: a state of fewer rows cannot
            # fill it (export itself traces rows 0..B-1)
            raise ValueError(f"max_rows must be >= the largest bucket ({self.buckets[-1]}), got "
                             f"{self.max_rows}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.prefill_chunks = resolve_prefill_chunks(self.prefill_chunks, self.max_seq_len)

    def precision(self):
        return Precision(dtype=DTYPES[self.dtype], act_quant=self.act_quant, kv_fp8=self.kv_fp8)

    def cache(self, block: int):
        return CacheConfig(max_rows=self.max_rows, max_seq_len=self.max_seq_len,
                           max_step_tokens=max(self.prefill_chunk, block + 1,
                                               *self.prefill_chunks))

    def rope_positions(self, block: int) -> int:
        """RoPE table length of the built programs: the step's (models/config.py) plus the
        largest prefill chunk, whose padded tail runs on past the last prompt position
        (models/prefill_chunk.py)."""
        return rope_positions(self.max_seq_len, block) + max(self.prefill_chunks, default=0)

    def to_manifest(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in NOT_RECORDED}


# The default engine's prefill chunk lengths: powers of two from 64 up to min(512, max_seq_len).
# 64 covers short prompts with little padding; each doubling halves the calls of a long prompt;
# past 512 a chunk's forward is long enough that fewer calls no longer pay for the larger state
# ring (every SWA / compressor ring holds max_step_tokens more entries per row) and build time.
PREFILL_CHUNK_MIN, PREFILL_CHUNK_MAX = 64, 512


def default_prefill_chunks(max_seq_len: int) -> tuple:
    """Powers of two from 64 up to min(512, max_seq_len); none when max_seq_len < 64."""
    out, c = [], PREFILL_CHUNK_MIN
    while c <= min(PREFILL_CHUNK_MAX, max_seq_len):
        out.append(c)
        c *= 2
    return tuple(out)


def resolve_prefill_chunks(chunks, max_seq_len) -> tuple:
    """prefill_chunks as sorted distinct ints in [1, max_seq_len]; (0,) and () mean none,
    "auto" default_prefill_chunks(max_seq_len)."""
    if chunks == "auto":
        ok = isinstance(max_seq_len, int) and not isinstance(max_seq_len, bool)
        return default_prefill_chunks(max_seq_len) if ok else ()
    if isinstance(chunks, (int, str)) or not hasattr(chunks, "__iter__"):
        raise ValueError(f"prefill_chunks must be a sequence of chunk lengths, got {chunks!r}")
    chunks = tuple(chunks)
    if chunks == (0,):
        return ()
    # the upper bound only once max_seq_len is an int (build_checks names a bad one)
    top = max_seq_len if isinstance(max_seq_len, int) and not isinstance(max_seq_len, bool) \
        else float("inf")
    bad = [c for c in chunks if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= top]
    if bad:
        raise ValueError(f"prefill_chunks must be ints in [1, max_seq_len={max_seq_len}] (0 "
                         f"alone: none), got {list(chunks)}")
    return tuple(sorted(set(chunks)))
