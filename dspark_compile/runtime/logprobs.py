"""Log-probabilities of the committed tokens: the target's, as its verification logits give them.

What a logprob is here (docs/serve.md, "Logprobs"): log_softmax of the target's raw logits at
the token's position, before temperature, top-k and top-p (vLLM's default `logprobs_mode`,
raw_logprobs). Speculative decoding does not change it: every committed token, an accepted
draft or the token after them, is one the step's verification forward scored at its position,
and the logprob is read from those logits, whatever the draft proposed.

Where they come from, per kind of call:

    step     a logprobs variant of each loaded step program (full and greedy sampler plans):
             the program's own graph with, right after its `dspark::rejection_sample` call, a
             few aten ops over the same target logits [B, N+1, V] (logsumexp, gather of the
             committed token, topk 20) and one more output, `payload` [B, (N+1) (1 + 2 K)]
             float32: per verified position the committed token's logprob, the top K logprobs,
             their ids. Derived here at load from the checked graph (no build change: every
             aten engine has it, old ones too), run only for steps where a row asks, so a
             step no row asks for runs the program as built.
    prefill  the same over a prefill program's `dspark::sample` call ([1, V]: the first
             token's), used for a prompt's last chunk when its request asks; the eager
             reference's prefill returns its logits and the same function reads them.
    prompt   (echo) the engine's eager reference of the target over the prompt on the
             request's own state row before its prefill (which rewrites every position the
             pass wrote: a row is reused without clearing), logits at every position: the
             programs keep only the last position's logits, and a prefill variant with every
             position's head would cost C V fp32 logits per chunk for every prompt.

An Inductor engine's steps are compiled code, not a graph to extend: it has no logprobs
(`refusal` says so). Packing: the payload's float32 bits ride in the step's one int64 output
(cuda_graphs.pack), so a logprobs step is still one device-to-host copy.
"""
from __future__ import annotations

import copy
import operator
from collections.abc import Sequence

import torch
from torch.utils import _pytree as pytree

from dspark_compile.engine_dir.format import STEP, ProgramKey
from dspark_compile.engine_dir.graph_program import GraphProgram, _Ref

# the most top logprobs a request may ask (vLLM's cap, and OpenAI's top_logprobs <= 20); the
# programs compute this many for every row of a logprobs step, a request takes its first k
MAX_LOGPROBS = 20
_PREFIX = "logprobs_"

aten = torch.ops.aten


def width(n1: int, k: int = MAX_LOGPROBS) -> int:
    """Payload columns of `n1` positions."""
    return n1 * (1 + 2 * k)


def payload(logits: torch.Tensor, tokens: torch.Tensor, k: int = MAX_LOGPROBS) -> torch.Tensor:
    """The payload of `tokens` [..., T] scored by `logits` [..., T, V] (raw): [..., T (1 + 2k)]
    float32, per position (logprob of the token, top-k logprobs, their ids). What the derived
    programs compute, as a function (the eager paths and the tests use it). A token < 0
    (nothing committed there) reads id 0's logprob: never delivered."""
    lse = torch.logsumexp(logits, -1, keepdim=True)
    vals, ids = torch.topk(logits, min(k, logits.shape[-1]), -1)
    chosen = logits.gather(-1, tokens.clamp_min(0).unsqueeze(-1)) - lse
    out = torch.cat((chosen.float(), (vals - lse).float(), ids.float()), -1)
    return out.flatten(-2)


def derive(program: GraphProgram, k: int = MAX_LOGPROBS) -> GraphProgram | None:
    """`program` with the payload of its sampler's tokens as one more output (the module
    docstring): (tokens, num, payload) of a step, (first, payload) of a prefill program; None
    when it has no single `dspark::rejection_sample` or `dspark::sample` call (a build
    without the fuse_sampler pass) or its outputs are not tensors in a flat tuple. The
    program itself is untouched; the copy shares its inputs, constants and bound weights."""
    spec = program.out_spec
    if spec.is_leaf():                    # a prefill program's first token
        n_out = 1
    elif spec.type is tuple and all(c.is_leaf() for c in spec.children()):
        n_out = spec.num_children         # a step's (tokens, num)
    else:
        return None
    ops = {torch.ops.dspark.rejection_sample.default: True,
           torch.ops.dspark.sample.default: False}
    found = [(i, n) for i, n in enumerate(program.nodes) if n[1] in ops]
    if len(found) != 1:
        return None
    i, (name, op, args, kwargs) = found[0]
    logits = args[0] if args else kwargs.get("target_logits", kwargs.get("logits"))
    if not isinstance(logits, _Ref):
        return None
    taken = {n[0] for n in program.nodes} | {x.name for x in program.inputs}
    if any(t.startswith(_PREFIX) for t in taken):
        return None
    nodes: list = []

    def node(suffix: str, fn, *a, **kw) -> _Ref:
        nodes.append((_PREFIX + suffix, fn, a, kw))
        return _Ref(_PREFIX + suffix)

    tokens = (node("tokens", operator.getitem, _Ref(name), 0) if ops[op] else _Ref(name))
    lse = node("lse", aten.logsumexp.default, logits, [-1], True)
    top = node("top", aten.topk.default, logits, k, -1)
    vals = node("top_values", aten.sub.Tensor, node("top_raw", operator.getitem, top, 0), lse)
    ids = node("top_ids", operator.getitem, top, 1)
    at = node("at", aten.unsqueeze.default, node("clamped", aten.clamp_min.default, tokens, 0), -1)
    chosen = node("chosen", aten.sub.Tensor,
                  node("gathered", aten.gather.default, logits, -1, at), lse)
    f32 = dict(dtype=torch.float32)
    cat = node("cat", aten.cat.default,
               [node("chosen32", aten._to_copy.default, chosen, **f32),
                node("values32", aten._to_copy.default, vals, **f32),
                node("ids32", aten._to_copy.default, ids, **f32)], -1)
    out = node("payload", aten.flatten.using_ints, cat, -2, -1)
    derived = copy.copy(program)
    derived.rel = f"{program.rel} (logprobs)"
    derived.nodes = program.nodes[:i + 1] + nodes + program.nodes[i + 1:]
    derived.outputs = list(program.outputs) + [("user", None, out)]
    derived.out_spec = pytree.tree_structure(tuple(range(n_out + 1)))
    return derived


def logprob_table(table: dict, runner) -> dict:
    """{ProgramKey: callable} of the step programs in `table` (the engine's, keyed by
    ProgramKey, values with `.fn`) that have a logprobs variant; `runner(GraphProgram)` makes
    a callable (graph_run.ProgramRunner). One derivation per program object: a program
    exported with a dynamic batch serves every bucket."""
    out, memo = {}, {}
    for key, prog in table.items():
        if key.kind != STEP:
            continue
        gp = getattr(prog.fn, "_program", None)     # a ProgramRunner's (an Inductor step: none)
        if not isinstance(gp, GraphProgram):
            continue
        if id(gp) not in memo:
            derived = derive(gp)
            memo[id(gp)] = None if derived is None else runner(derived)
        if memo[id(gp)] is not None:
            out[key] = memo[id(gp)]
    return out


# ---- host side -----------------------------------------------------------------------------

def to_bits(p: torch.Tensor) -> torch.Tensor:
    """float32 payload -> int64 columns holding its bits (one int64 output per step)."""
    return p.contiguous().view(torch.int32).to(torch.int64)


def from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).view(torch.float32)


def decode(p: torch.Tensor, n1: int, k: int = MAX_LOGPROBS) -> tuple[list, list, list]:
    """A payload [n, n1 (1 + 2k)] (float32, or its bits as a launch's int64 columns hold
    them) -> Python lists (chosen [n][n1], top values [n][n1][k], top ids [n][n1][k])."""
    if p.dtype == torch.int64:
        p = from_bits(p)
    p = p.reshape(p.shape[0], n1, 1 + 2 * k)
    return (p[..., 0].tolist(), p[..., 1:1 + k].tolist(),
            p[..., 1 + k:].to(torch.int64).tolist())


def entries(chosen: list, values: list, ids: list, n: int, k: int) -> list:
    """The first `n` positions of one row as [(logprob, ((id, logprob), ... top k))]."""
    return [(chosen[j], tuple(zip(ids[j][:k], values[j][:k]))) for j in range(n)]


class Entries(Sequence):
    """A request's logprob entries of one event, decoded when first read: the engine thread
    only keeps each launch's payload row (a view of the launch's host copy, which nothing
    reuses) and the consumer (the server's handler) pays the decode, ~80 us a row of 20 top
    logprobs on a 2-core CPU, off the step loop. A sequence of (logprob, ((id, logprob), ...)),
    one per committed token."""

    def __init__(self):
        self._chunks: list | None = []      # (payload row [1, W], positions, first n, k)
        self._n = 0
        self._list: list | None = None

    def add(self, row: torch.Tensor, n1: int, n: int, k: int) -> None:
        self._chunks.append((row, n1, n, k))
        self._n += n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if self._list is None:
            out: list = []
            for row, n1, n, k in self._chunks:
                c, v, ids = decode(row, n1)
                out += entries(c[0], v[0], ids[0], n, k)
            self._list, self._chunks = out, None
        return self._list[i]

    def __eq__(self, other):
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"Entries({list(self)!r})"


@torch.no_grad()
def prompt_logprobs(model, state: dict, row: int, prompt: list[int], chunk: int,
                    k: int) -> list:
    """The target's logprobs of every prompt token after the first, by the eager reference
    over the prompt on state row `row` (the module docstring says why that row may be used):
    [None, (logprob, top k), ...], one entry per prompt token."""
    from dspark_compile.models.batch import Batch
    from dspark_compile.models.state import check_prefill
    check_prefill(model, state, row, prompt, chunk, False)
    dev = state["row.last_pos"].device
    trash = state["row.last_pos"].shape[0] - 1
    ids = torch.tensor(prompt, dtype=torch.int64, device=dev)
    rows = torch.tensor([row], device=dev)
    parts = []
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        batch = Batch.make(rows, torch.arange(start, end, device=dev)[None],
                           ids[None, start:end], trash, model.cfg.vocab_size)
        logits, _ = model(batch, state)                       # [1, T, V]
        # position p's logits score token p + 1: the last prompt position scores nothing here
        nxt = ids[start + 1:end + 1]
        lg = logits[0, :nxt.shape[0]]
        if nxt.shape[0]:
            parts.append(payload(lg, nxt, k).reshape(nxt.shape[0], 1 + 2 * k))
    out: list = [None]
    if parts:
        p = torch.cat(parts).cpu()
        c, v, i = decode(p.reshape(1, -1), p.shape[0], k)
        out += entries(c[0], v[0], i[0], p.shape[0], k)
    return out


def refusal(engine) -> str | None:
    """Why `engine` cannot return logprobs (None: it can): every bucket's step and every
    prefill chunk's program need their variant (a logprobs step may run at any bucket)."""
    have = getattr(engine, "logprob_programs", {})
    pp = getattr(engine, "prefill_programs", None)
    if (all(ProgramKey(STEP, b) in have for b in engine.buckets)
            and (pp is None or set(pp.logprob_modules) == set(pp.chunks))):
        return None
    if getattr(engine, "backend", "aten") == "inductor":
        return ("this engine was built with --backend inductor, whose compiled steps return no "
                "logprobs: rebuild it with --backend aten to serve logprobs")
    return ("this engine's step or prefill programs have no logprobs variant (built without "
            "the fuse_sampler pass, whose sampler call the variant reads the target's logits "
            "at; loaded with logprobs=False; or a variant's CUDA-graph capture failed, as the "
            "load warned): rebuild it with the default passes to serve logprobs")
