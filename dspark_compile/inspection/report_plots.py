"""The build report's plots, as inline SVG strings (matplotlib, Agg backend, text as paths).

Text drawn as paths (`svg.fonttype: path`) keeps every SVG self-contained: the page needs no
font and no network. Each function returns the `<svg ...>...</svg>` markup alone (the XML
prologue and DOCTYPE matplotlib writes are dropped: an HTML page cannot hold them inline).
"""
from __future__ import annotations

import io

EXTRA = "report"

# waterfall colours: a pass that removed nodes, one that added nodes, the totals
_DOWN, _UP, _TOTAL = "#2a9d8f", "#e76f51", "#577590"


def check_matplotlib_available() -> None:
    """Raise a one-line ValueError naming the extra when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"--report needs matplotlib: pip install 'dspark-compile[{EXTRA}]'") \
            from None


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _svg(fig) -> str:
    plt = _pyplot()
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "path", "svg.hashsalt": "dspark"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def waterfall(rows: list, title: str) -> str:
    """Node count after each pass: a floating bar per pass from the count before it to the
    count after it, the exported and the final count as full bars."""
    plt = _pyplot()
    labels = ["exported"] + [r["name"] for r in rows] + ["final"]
    start = rows[0]["nodes_before"] if rows else 0
    bottoms, heights, colours = [0], [start], [_TOTAL]
    for r in rows:
        lo, hi = sorted((r["nodes_before"], r["nodes_after"]))
        bottoms.append(lo)
        heights.append(max(hi - lo, 0))
        colours.append(_UP if r["nodes_after"] > r["nodes_before"] else _DOWN)
    final = rows[-1]["nodes_after"] if rows else start
    bottoms.append(0)
    heights.append(final)
    colours.append(_TOTAL)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(labels)), 3.6))
    ax.bar(range(len(labels)), heights, bottom=bottoms, color=colours, width=0.7)
    for i, r in enumerate(rows, start=1):
        delta = r["nodes_after"] - r["nodes_before"]
        if delta:
            ax.annotate(f"{delta:+d}", (i, bottoms[i] + heights[i]), ha="center", va="bottom",
                        fontsize=7)
    ax.annotate(str(start), (0, start), ha="center", va="bottom", fontsize=7)
    ax.annotate(str(final), (len(labels) - 1, final), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("graph nodes")
    ax.set_title(title, fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    return _svg(fig)


def fused_ops_bars(counts: dict) -> str:
    """Calls of each `dspark::` op per bucket: {bucket: {op: calls}} as grouped bars."""
    plt = _pyplot()
    buckets = sorted(counts, key=int)
    ops = sorted({op for c in counts.values() for op in c})
    width = 0.8 / max(len(buckets), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(ops)), 3.4))
    for j, b in enumerate(buckets):
        ax.bar([i + j * width for i in range(len(ops))], [counts[b].get(op, 0) for op in ops],
               width=width, label=f"bucket {b}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ops))], ops, rotation=40, ha="right",
                  fontsize=8)
    ax.set_ylabel("calls in the program")
    ax.set_title("dspark:: ops per kind", fontsize=10)
    ax.legend(fontsize=7, ncol=min(len(buckets), 4))
    ax.spines[["top", "right"]].set_visible(False)
    return _svg(fig)


def step_latency(rows: list) -> str:
    """The step benchmark's median latency per bucket, one line per case and variant."""
    plt = _pyplot()
    series: dict = {}
    for r in rows:
        if r.get("us_median"):
            series.setdefault(f"{r.get('case')} / {r.get('variant')}", []).append(
                (r["B"], r["us_median"]))
    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ticks = sorted({p[0] for pts in series.values() for p in pts})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("bucket (rows)")
    ax.set_ylabel("µs per step (median)")
    ax.set_title("step benchmark", fontsize=10)
    ax.legend(fontsize=7)
    ax.spines[["top", "right"]].set_visible(False)
    return _svg(fig)
