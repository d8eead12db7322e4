"""Fuse the mHC hyper-connections: every `hc_pre` / `hc_post` / `hc_head` region becomes one
`dspark::` op (kernels/mhc.py), then each fused post is merged with the pre or head its output
stream feeds: `hc_post_pre` / `hc_post_head`.

Unfused (per call site, what the references export to; a pre is ~150 aten nodes, 120 of them
the 20 Sinkhorn passes):

    pre   X ─ flatten ─ to(f32) ─ pow ─ mean ─ add ─ rsqrt ─┐
            └──────── mm(fnᵀ) ────────────────────────── mul ─ slice ×3 ─ mul(scale) ─ add(base)
              ─ sigmoid ─ add(eps) ─ mul(X) ─ sum ─ to ──► a
              ─ sigmoid ─ mul(2) ──────────────────────► post
              ─ view ─ softmax ─ add ─ (sum ─ add ─ div) × 39 ─► comb
    post  y, X, post, comb ─ einsum(comb, X) ─ mul(post, y) ─ add ─ to ─► X'
    head  X ─ [pre's rms and mm, fn [m, mD]] ─ sigmoid ─ add ─ mul(X) ─ sum ─ to ─► h

Fused, per block (target layers and draft stages alike):

    X', a, post, comb = dspark.hc_post_pre(y_attn, X, post, comb, fn_ffn, ...)   # attn post
    X', a, post, comb = dspark.hc_post_pre(y_ffn, X', post, comb, fn_attn, ...)  # ffn post
    ...                                                      # (+ ffn pre / next block's pre)
    X', h             = dspark.hc_post_head(y_ffn, X', post, comb, fn_head, ...) # last block
with one plain `dspark.hc_pre` on the embedded stream of each forward (target, draft).

Why the merge is a graph rewrite and not a model-level region: the pairs cross module
boundaries (block i's hc_ffn.post and block i+1's hc_attn.pre; the last block and the head
live in different modules and forwards), and the stream between them has other readers (the
draft's conditioning reads the target's stream after its aux layers, the next post reads it as
its residual). A region must be one reference call, so merging there would force the blocks to
hand a pending post to their successor. In the graph the condition is plain dataflow: a fused
`hc_post` whose output is the X of an `hc_pre` / `hc_head`. The merged op runs where the post
ran (its X' output replaces the post's for every other reader); the pre moves up to it, which
is safe when its other inputs (weights) are defined before the post and nothing between the two
has a side effect. Option `merge: False` stops after the per-site fusion.

Memory traffic per row at Flash dims (D = 4096, m = 4, bf16): eager aten materialises X in fp32
(64 KB) twice per pre, the [T, 24] projection and ~120 tiny Sinkhorn tensors, and X' in fp32
before its cast; the fused pre reads X (32 KB) and writes a (8 KB); the merged post + pre reads
y and X (40 KB), writes X' (32 KB), reads X' back once for the weighted sum and writes a — and
one site costs 2 launches instead of ~150 (fn, 1.5 MB per site, is read from L2 per row tile).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from dspark_compile.kernels import mhc as _kernels  # noqa: F401  (registers the ops)

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.graph_utils import has_side_effects
from dspark_compile.passes.regions import fuse_regions
from dspark_compile.passes.registry import register_pass

OPS = ("hc_pre", "hc_post", "hc_head", "hc_post_pre", "hc_post_head")
# consumer of a fused post's X' -> the merged op; the consumer returns a tuple (pre) or not (head)
MERGES = {"hc_pre": "hc_post_pre", "hc_head": "hc_post_head"}
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "seq_nr")


def _op(name: str):
    return getattr(torch.ops.dspark, name).default


def _named_args(node: Node) -> dict:
    """The node's arguments by schema parameter name (fuse_regions inserts them positionally)."""
    schema = node.target._schema
    named = {a.name: v for a, v in zip(schema.arguments, node.args)}
    named.update(node.kwargs)
    return named


def _fake_vals(op, args: list):
    vals = [a.meta["val"] if isinstance(a, Node) else a for a in args]
    mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode:
        return op(*vals)


def _mergeable(post: Node, consumer: Node) -> bool:
    """The consumer can run where the post runs: its other inputs exist there and nothing in
    between has a side effect."""
    order = {n: i for i, n in enumerate(post.graph.nodes)}
    others = [n for n in consumer.all_input_nodes if n is not post]
    if any(order[n] > order[post] for n in others):
        return False
    n = post.next
    while n is not consumer:
        if has_side_effects(n):
            return False
        n = n.next
    return True


def _merge(gm: torch.fx.GraphModule, post: Node, consumer: Node, merged_name: str) -> None:
    """Replace post and consumer by one merged op at the post's place."""
    graph = gm.graph
    op = _op(merged_name)
    named = {**_named_args(consumer), **_named_args(post)}     # X: the post's input stream
    args = [named[a.name] for a in op._schema.arguments]
    vals = _fake_vals(op, args)
    with graph.inserting_after(post):
        fused = graph.call_function(op, tuple(args))
    fused.meta.update({k: post.meta[k] for k in _KEPT_META if k in post.meta})
    fused.meta["val"] = tuple(vals)
    fused.meta["custom"] = {"dspark_fused": merged_name}
    outs, prev = [], fused
    for j, v in enumerate(vals):
        with graph.inserting_after(prev):
            prev = graph.call_function(operator.getitem, (fused, j))
        prev.meta.update({k: fused.meta[k] for k in _KEPT_META if k in fused.meta})
        prev.meta["val"] = v
        outs.append(prev)
    post.replace_all_uses_with(outs[0], delete_user_cb=lambda u: u is not consumer)
    if isinstance(consumer.meta["val"], torch.Tensor):             # head: one bare tensor
        consumer.replace_all_uses_with(outs[1])
    else:
        for item in list(consumer.users):                        # getitem(consumer, j)
            item.replace_all_uses_with(outs[1 + item.args[1]])
            graph.erase_node(item)
    graph.erase_node(consumer)
    graph.erase_node(post)


def merge_post_into_consumer(gm: torch.fx.GraphModule) -> dict:
    """Merge every fused hc_post with the hc_pre / hc_head that reads its X'; per merged op, how
    many times."""
    merged = dict.fromkeys(MERGES.values(), 0)
    post_op = _op("hc_post")
    consumers = {_op(name): name for name in MERGES}
    for post in [n for n in gm.graph.nodes if n.target is post_op]:
        readers = [u for u in post.users if u.target in consumers
                   and _named_args(u).get("X") is post]
        if len(readers) != 1 or not _mergeable(post, readers[0]):
            continue
        name = MERGES[consumers[readers[0].target]]
        _merge(gm, post, readers[0], name)
        merged[name] += 1
    return merged


@register_pass(name="fuse_mhc", stage="fusion", expect_match=True)
def fuse_mhc_pass(gm, ctx) -> PassResult:
    """Replace hc_pre / hc_post / hc_head regions by their dspark:: ops, then merge each post
    with the pre or head its output feeds."""
    result = fuse_regions(gm, OPS, ctx)
    if ctx is None or ctx.options().get("merge", True):
        result.notes["merged"] = merge_post_into_consumer(gm)
    return result
