"""Remove the runtime assertion nodes torch.export inserts.

What torch 2.13 non-strict export actually puts in the step graph (inspected):
- `aten._assert_tensor_metadata(x, dtype=, device=, layout=)` before every `.to(...)`;
- `aten._assert_scalar(sym_expr, msg)` for `torch._check`s and for the ranges of unbacked
  SymInts (`.item()`, `nonzero`), with the `operator.ge/le/lt` nodes computing `sym_expr`;
- `aten.sym_constrain_range(_for_size)` for constrained unbacked sizes.
Also handled, for other torch versions/decompositions: `_assert_async(.msg)`, the functional
variants `_functional_assert_async` / `_functional_sym_constrain_range(_for_size)` /
`_functional_assert_scalar`.

Why this is safe: each bucket's program is exported with static shapes and dtypes, so the
metadata checks restate facts the graph was traced under; a captured CUDA graph could not act
on a failed scalar assertion anyway. Why it is needed: the assertions hold extra users of
tensors and SymInts, which hide patterns from fusion passes and keep dead nodes alive.

A functional assertion whose result token is still used is left alone (removing it would break
the token chain). The comparison nodes feeding removed assertions are left for `dce`.
"""
from __future__ import annotations

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.graph_utils import ASSERT_OPS, op_name
from dspark_compile.passes.registry import register_pass


@register_pass(name="remove_asserts", stage="cleanup")
def remove_asserts_pass(gm, ctx) -> PassResult:
    """Erase export-inserted assertion nodes."""
    removed, kept, kinds = 0, 0, {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in ASSERT_OPS:
            continue
        if node.users:
            kept += 1
            continue
        kinds[op_name(node)] = kinds.get(op_name(node), 0) + 1
        gm.graph.erase_node(node)
        removed += 1
    return PassResult(removed, notes={"removed": kinds, "kept_with_users": kept})
