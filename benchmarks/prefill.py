"""One prompt's prefill, the reference and the engine's prefill programs, side by side in one run:

    python benchmarks/prefill.py --preset flash-slice --prompt-len 1024 --chunks 512 --out DIR
    python benchmarks/prefill.py --dry-run --out DIR     # CPU: tiny, a 40-token prompt, no timing

synth checkpoint (or reuse --work) -> build_engine with bucket 1 and one prefill program per
--chunks length -> Engine.load (on CUDA: its graphs, the prefill programs' too) -> a random
prompt of --prompt-len ids for state row 0, greedy, the state snapshotted -> one reference
prefill (models/step.py `prefill`, chunk = the largest --chunks) recording the routers' top-k
ids and the weights each part of it reads -> the floor -> variants:
  - `eager`: that reference prefill called eagerly (on CUDA its dspark:: ops run our Triton
    kernels, each launched from the host);
  - `engine`: `Engine.prefill`: the prefill programs' CUDA graphs replayed over the prompt's
    chunk_schedule (models/prefill_chunk.py);
  - per variant: median / p10 / p90 µs over --replays calls after --warmup (CUDA events around
    the call: input staging and the first token's read-back included), the snapshot restored
    and L2 flushed before each call outside the timed region; each call's first token checked
    against the reference's; ratio to the floor.
-> JSON (rewritten after every variant, "complete": false until the end), CSV, a table.

Floor = max(bytes / copy bandwidth, FLOPs / bf16 tensor-core rate), both measured in this run
(harness.measure_copy_bandwidth; an 8192^3 bf16 torch.mm); `bound` names the larger. Chunks are
the reference's (the prompt cut at the largest chunk length: no padding). Counted:
- weights read, per chunk, once each: every weight an op of that chunk's part of the reference
  run reads (a dispatch mode maps the ops' tensor arguments onto the weights' address ranges;
  module pre-hooks name the part), except
  - routed experts: only those the chunk's tokens route to (step_floor.record_routing), bytes x
    distinct experts / n_routed_experts;
  - gathered tables: the embedding (the chunk's ids, plus the draft block's N in the last
    chunk), a hash gate's tid2eid (its routed tokens), the Markov W1 (N rows), the RoPE tables
    (non-persistent buffers: one row per position);
  - the target's head (hc_head, norm, LM head) and the draft block (mtp.* past the context
    store): the last chunk only (only the last position's logits are sampled); the programs run
    them in every chunk (any chunk may be the last), so a prompt of k chunks carries k - 1 head
    and draft reads above the floor (at flash-slice and 1,024 / 512: one more ~1 GB head read);
- state written per chunk: min(ring, tokens) entries of each ring (SWA KV, compressor and
  indexer rings, draft context), the entries whose block closes in the chunk (C4 / C128 KV,
  indexer K); row.tokens / draft_logits / last_pos and the sampled fp32 logits once;
- FLOPs: 2 x the elements of each matrix weight a token uses x tokens (packed MXFP4 bytes are
  two elements; a routed expert tensor counts num_experts_per_tok / n_routed_experts of it);
  tokens: the prompt's (target layers, context store), 1 (target head), N (draft block); plus
  attention, 4 x heads x head_dim per (query, key) (QK and PV over the shared latent) over the
  SWA window and the compressed candidates (C4: the indexer's top-k of the closed entries,
  C128: all closed entries), the C4 indexer's scores (2 x index heads x index_head_dim per
  closed entry), and the draft's N queries over its context ring and block.
Not counted: activations between ops, later chunks' cache reads (window and compressed
entries: small next to the weights), vector ops (norms, RoPE, mHC mixing).

`--dry-run`: the same code on the CPU, one untimed call per variant, the floor from CPU rates
(a smoke value), the JSON (tests/benchmarks/test_prefill_bench.py).
"""
from __future__ import annotations

import argparse
import bisect
import os
import sys
import time
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402
import step_floor  # noqa: E402
from bench_setup import begin, log, setup_engine  # noqa: E402
from step_variants import Runner, _cpu_copy_bandwidth, _l2_flusher, time_runner  # noqa: E402

VARIANTS = ("eager", "engine")
SCHEMA = "dspark-prefill-benchmark/1"
ROW = 0
TABLE = ["variant", "status", "first_token", "check", "us_median", "us_p10", "us_p90",
         "floor_us", "floor_bound", "ratio_to_floor"]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_args.add_preset(p)
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt tokens (default 1024; --dry-run 40)")
    p.add_argument("--chunks", type=bench_args.ints, default=None,
                   help="the build's --prefill-chunks, comma-separated (default 512; --dry-run 16)")
    bench_args.add_dtype(p)
    bench_args.add_backend(p, default="aten")
    p.add_argument("--replays", type=int, default=10, help="timed calls per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before them")
    bench_args.add_run_flags(p, "prefill", "CPU, tiny, a short prompt, no timing",
                             seed_help="the prompt's ids")
    a = p.parse_args(argv)
    if a.dry_run:
        a.preset = "tiny"
    a.prompt_len = a.prompt_len or (40 if a.dry_run else 1024)
    a.chunks = a.chunks or ([16] if a.dry_run else [512])
    if a.prompt_len < 1 or a.replays < 1 or a.warmup < 0:
        p.error(f"--prompt-len ({a.prompt_len}) and --replays ({a.replays}) must be >= 1, "
                f"--warmup ({a.warmup}) >= 0")
    bench_args.dry_run_defaults(a, "dtype")
    # room for the prompt, the first draft block and the step's lookahead after it
    a.max_seq_len = max(a.prompt_len + 64, a.chunks[-1])
    a.buckets, a.variants = [1], list(VARIANTS)     # what bench_setup.setup_engine reads
    return a


def model_weights(model) -> dict:
    """name -> tensor of every parameter and buffer, shared tensors once."""
    out, seen = {}, set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if t.numel() and key not in seen:
            seen.add(key)
            out[name] = t
    return out


class WeightUse(TorchDispatchMode):
    """Records, per (part, chunk), the weights some op's tensor argument lies in (by address
    range, so views and slices of a weight count as it). Parts, set by module pre-hooks: `chunk`
    (the target's forward), `head` (its hc_head and what follows: norm, LM head), `context`
    (mtp.0.main_proj onwards: the draft context store), `draft` (the draft block's stages)."""

    def __init__(self, model):
        super().__init__()
        self.weights = model_weights(model)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n)
                       for n, t in self.weights.items())
        self.starts = [s[0] for s in spans]
        self.spans = spans
        self.part, self.chunk, self.tokens = None, -1, []
        self.used: dict[tuple, set] = {}
        self.parts = [(model, "chunk"), (model.hc_head, "head"),
                      (model.mtp[0].main_proj, "context")] + [(m, "draft") for m in model.mtp]

    def _enter_part(self, part: str):
        def hook(mod, args):
            if part == "chunk":       # the target's forward: a new chunk (args[0]: its Batch)
                self.chunk += 1
                self.tokens.append(int(args[0].B * args[0].T))
            self.part = part
        return hook

    def __enter__(self):
        self.handles = [m.register_forward_pre_hook(self._enter_part(p)) for m, p in self.parts]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def _name(self, t: torch.Tensor) -> str | None:
        p = t.data_ptr()
        i = bisect.bisect_right(self.starts, p) - 1
        return self.spans[i][2] if i >= 0 and p < self.spans[i][1] else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.part is not None:
            for a in tree_leaves((args, kwargs or {})):
                if isinstance(a, torch.Tensor) and a.numel() and a.device.type != "meta":
                    name = self._name(a)
                    if name is not None:
                        self.used.setdefault((self.part, self.chunk), set()).add(name)
        return func(*args, **(kwargs or {}))


def _expert_moe(name: str) -> str | None:
    moe, _, leaf = name.rpartition(".experts.")
    return moe if leaf else None


def _gather_rows(name: str, persistent: set) -> bool:
    return (name == "embed.weight" or name.endswith(".gate.tid2eid")
            or name.endswith("markov_head.markov_w1.weight") or name not in persistent)


def _matrix_elements(name: str, t: torch.Tensor, persistent: set) -> int:
    """Elements a token multiplies by (0 for vectors, scales, id tables, gathered rows and the
    compressors' `ape`, a position table added to the pooled rows)."""
    if (t.dim() < 2 or t.dtype in (torch.uint8, torch.int64) or name.endswith(".ape")
            or _gather_rows(name, persistent)):
        return 0
    return t.numel() * (2 if t.dtype == torch.int8 else 1)     # int8: two packed e2m1 values


PARTS = ("chunk", "context", "head", "draft")
LAST_ONLY = ("head", "draft")     # only the last position's logits and one draft block matter


def _routing_by_chunk(use: WeightUse, routing: dict) -> dict:
    """moe prefix -> {chunk: top-k ids}: a gate's i-th call routed the i-th chunk that read
    its experts (a target gate: every chunk; a draft gate: the last, its one call)."""
    out = {}
    for gate, ids in routing.items():
        moe = gate[:-len(".gate")]
        at = [c for c in range(len(use.tokens))
              if any(_expert_moe(n) == moe for p in PARTS for n in use.used.get((p, c), ()))]
        out[moe] = dict(zip(at, ids))
    return out


def _read_bytes(name: str, t: torch.Tensor, rows: int, ids, tid_ids, E: int,
                persistent: set) -> tuple[int, str]:
    """(bytes one chunk reads of weight `name`, kind); rows: the rows a gathered table gives."""
    n = step_floor._nbytes(t)
    if ids is not None:
        return n * int(torch.unique(ids).numel()) // E, "experts"
    if _gather_rows(name, persistent):
        rows = tid_ids.shape[0] if tid_ids is not None else rows
        return min(t.shape[0], rows) * (n // max(t.shape[0], 1)), "gathered"
    return n, "whole"


def weight_floor(model, use: WeightUse, routing: dict) -> dict:
    """Bytes and FLOPs of the weights, per the module docstring."""
    cfg = model.cfg
    E, N = cfg.n_routed_experts, cfg.dspark_block_size
    persistent = set(model.state_dict())
    last = len(use.tokens) - 1
    calls = _routing_by_chunk(use, routing)
    per_chunk, kinds, flops = [], {"experts": 0, "gathered": 0, "whole": 0}, {p: 0 for p in PARTS}
    for c in range(last + 1):
        tokens = {"chunk": use.tokens[c], "context": use.tokens[c], "head": 1, "draft": N}
        read = set()
        for part in PARTS:
            if part in LAST_ONLY and c != last:
                continue
            for name in use.used.get((part, c), ()):
                read.add(name)
                routed = calls.get(_expert_moe(name), {}).get(c) is not None
                frac = cfg.num_experts_per_tok / E if routed else 1.0
                flops[part] += int(2 * _matrix_elements(name, use.weights[name], persistent)
                                   * frac * tokens[part])
        chunk_bytes = 0
        for name in read:
            rows = N if name.endswith("markov_w1.weight") else \
                use.tokens[c] + (N if c == last else 0)
            tid = calls.get(name[:-len(".gate.tid2eid")], {}).get(c) \
                if name.endswith(".gate.tid2eid") else None
            b, kind = _read_bytes(name, use.weights[name], rows,
                                  calls.get(_expert_moe(name), {}).get(c), tid, E, persistent)
            kinds[kind] += b
            chunk_bytes += b
        per_chunk.append(chunk_bytes)
    return {"weights_bytes": int(sum(per_chunk)), "weights_bytes_per_chunk": per_chunk,
            "weights_by_kind": kinds, "weight_flops": int(sum(flops.values())),
            "weight_flops_by_part": flops, "n_routed_experts": E, "chunk_tokens": list(use.tokens),
            "model_weights_bytes": sum(step_floor._nbytes(t) for t in use.weights.values()),
            "experts_used_per_moe_per_chunk": {
                m: {str(c): int(torch.unique(i).numel()) for c, i in d.items()}
                for m, d in calls.items()},
            "weights_read": sorted({n for s in use.used.values() for n in s})}


def attention_flops(cfg, L: int) -> int:
    """Score and value FLOPs of the target's prompt positions and the draft's first block."""
    W, H, d, N = cfg.sliding_window, cfg.num_attention_heads, cfg.head_dim, cfg.dspark_block_size
    total = 0
    for ratio in cfg.compress_ratios[:cfg.num_hidden_layers]:
        for p in range(L):
            closed = (p + 1) // ratio if ratio else 0
            keys = min(p + 1, W) + (min(cfg.index_topk, closed) if ratio == 4 else closed)
            total += 4 * H * d * keys
            if ratio == 4:
                total += 2 * cfg.index_n_heads * cfg.index_head_dim * closed
    draft_keys = sum(min(L, W) + j + 1 for j in range(N))
    return total + cfg.n_mtp_layers * 4 * H * d * draft_keys


def state_written(model, state: dict, chunk_tokens: list[int]) -> dict:
    """Bytes of one row's state the prefill writes, per the module docstring."""
    cfg = model.cfg
    per, total = {}, 0
    starts = [sum(chunk_tokens[:i]) for i in range(len(chunk_tokens))]
    for name, t in state.items():
        row_bytes = step_floor._nbytes(t) // t.shape[0]
        w = 0
        ce = step_floor.cache_entry(cfg, name, t)
        if ce:
            entry, stride = ce
            for s, n in zip(starts, chunk_tokens):
                closed = (s + n) // stride - s // stride
                w += (min(t.shape[1], n) if stride == 1 else closed) * entry
        elif name in ("row.tokens", "row.draft_logits", "row.last_pos"):
            w = row_bytes
        per[name] = w
        total += w
    return {"state_written_bytes": int(total), "state_written_per_tensor": per}


def prefill_floor(model, state, use, routing, L, bw: float, rate: float) -> dict:
    w = weight_floor(model, use, routing)
    s = state_written(model, state, w["chunk_tokens"])
    logits = model.cfg.vocab_size * 4
    att = attention_flops(model.cfg, L)
    nbytes = w["weights_bytes"] + s["state_written_bytes"] + logits
    flops = w["weight_flops"] + att
    bytes_us, flops_us = nbytes / bw * 1e6, flops / rate * 1e6
    return {"bytes": int(nbytes), "flops": int(flops), "attention_flops": int(att),
            "logits_written_bytes": logits, "bytes_us": bytes_us, "flops_us": flops_us,
            "us": max(bytes_us, flops_us), "bound": "bytes" if bytes_us >= flops_us else "flops",
            **w, **s}


def run_variant(variant: str, eng, prompt, chunk, ctx, args, ref_first: int) -> dict:
    """One variant's calls (timed on CUDA, one untimed call on the CPU), each first token kept."""
    from dspark_compile.models.step import prefill
    firsts = []
    fn = ((lambda: prefill(eng.model, eng.state, ROW, prompt, chunk, speculative=True))
          if variant == "eager" else (lambda: eng.prefill(ROW, prompt)))
    row = {"variant": variant}
    r = Runner(lambda: firsts.append(fn()))
    if eng.device.type == "cuda":
        row.update(time_runner(r, ctx, args.replays, args.warmup))
    else:
        ctx["restore"]()
        with torch.no_grad():
            r.call()
        row.update(us_median=None, replays=1, method="cpu, untimed")
    ctx["restore"]()
    wrong = sorted({f for f in firsts if f != ref_first})
    row.update(first_token=firsts[0], calls=len(firsts), agrees=not wrong,
               check=("first token == reference's in every call" if not wrong else
                      f"first tokens {wrong} differ from the reference's {ref_first}"))
    return row


def main(argv=None) -> int:
    args = _args(argv)
    if (started := begin(args, "prefill")) is None:
        return 1
    env, out = started
    from dspark_compile.models.generate import set_row_sampling
    from dspark_compile.models.request import SamplingParams
    from dspark_compile.models.prefill_chunk import chunk_schedule
    from dspark_compile.models.state import restore_state, snapshot_state
    from dspark_compile.models.step import prefill

    rec = {"schema": SCHEMA, "complete": False, "dry_run": args.dry_run, "environment": env,
           "preset": args.preset, "dtype": args.dtype, "prompt_len": args.prompt_len,
           "chunks": args.chunks, "backend": args.backend, "max_seq_len": args.max_seq_len,
           "replays": args.replays, "warmup": args.warmup, "seed": args.seed,
           "variants": list(VARIANTS), "rows": []}

    with bench_args.work_dir(args, "prefill_bench_") as work, \
            bench_args.result_file(out / "prefill.json", rec) as write:
        eng, rec["setup"] = setup_engine(args, work, log, tuple(args.chunks))
        dev, chunk = eng.device, max(args.chunks)
        rec["schedule"] = chunk_schedule(args.prompt_len, eng.prefill_programs.chunks)
        g = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(0, eng.cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
        set_row_sampling(eng.state, ROW, SamplingParams())      # greedy
        snap = snapshot_state(eng.state)
        ctx = {"device": dev, "flush": _l2_flusher(dev),
               "restore": lambda: restore_state(eng.state, snap)}
        rec["copy_bandwidth"] = (harness.measure_copy_bandwidth() if dev.type == "cuda"
                                 else _cpu_copy_bandwidth())
        rec["mm_rate"] = harness.measure_mm_rate(dev)
        write()

        t = time.perf_counter()
        with torch.no_grad(), step_floor.record_routing(eng.model) as routing, \
                WeightUse(eng.model) as use:
            ref_first, logits = prefill(eng.model, eng.state, ROW, prompt, chunk,
                                        speculative=True, return_logits=True)
        ctx["restore"]()
        top2 = torch.topk(logits.float(), 2).values
        rec["reference"] = {"first_token": ref_first, "top2_margin": float(top2[0] - top2[1]),
                            "seconds": round(time.perf_counter() - t, 2)}
        log(f"[reference] first token {ref_first} (top-2 margin "
            f"{rec['reference']['top2_margin']:.3g}) in {rec['reference']['seconds']} s")
        bw, rate = rec["copy_bandwidth"]["bytes_per_s"], rec["mm_rate"]["flops_per_s"]
        floor = prefill_floor(eng.model, eng.state, use, routing, args.prompt_len, bw, rate)
        rec["floor"] = floor
        floor_line = (f"{floor['bytes'] / 1e9:.3f} GB at {bw / 1e9:.0f} GB/s -> "
                      f"{floor['bytes_us']:.1f} us, {floor['flops'] / 1e12:.3f} TFLOP at "
                      f"{rate / 1e12:.1f} TFLOP/s -> {floor['flops_us']:.1f} us: {floor['bound']}")
        log(f"[floor] {floor_line}")
        write()
        for v in VARIANTS:
            try:
                row = run_variant(v, eng, prompt, chunk, ctx, args, ref_first)
                row["status"] = "ok"
            except Exception as e:  # noqa: BLE001 -- one variant's failure is a result
                traceback.print_exc()
                row = {"variant": v, "status": "skipped",
                       "reason": f"{type(e).__name__}: {str(e)[:300]}"}
                ctx["restore"]()
            row.update(name=f"{args.preset} prefill L={args.prompt_len}", floor_us=floor["us"],
                       floor_bound=floor["bound"], floor_bytes=floor["bytes"],
                       floor_flops=floor["flops"])
            if row.get("us_median"):
                row["ratio_to_floor"] = row["us_median"] / floor["us"]
            rec["rows"].append(row)
            write()
            log(f"[{v}] {row['status']} " + (f"{row['us_median']:.1f} us " if row.get("us_median")
                                             else "") + str(row.get("check", row.get("reason"))))
        rec["complete"] = True

    harness.write_csv(str(out / "prefill.csv"), rec["rows"])
    print(f"\n{env.get('device')}  torch {env['torch']}  triton {env['triton']}  commit "
          f"{env['git_commit'][:12]}  {env['date_utc']}\nfloor: {floor_line}")
    print(harness.format_table(rec["rows"], TABLE))
    print(f"written: {out / 'prefill.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
