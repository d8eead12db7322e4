"""`inspect --report report.html`: one self-contained page on what the build did.

Everything comes from the engine directory, nothing is rebuilt or loaded into torch:

- per bucket, the node count after each pass (a waterfall, report_plots.py) and the pass table
  (time, nodes before and after, matches, verification) from the manifest's `pass_stats`;
- the `dspark::` ops each program calls, per kind, counted in the program file's graph
  (`programs/step_b{B}.json`, engine_dir/graph_format.py);
- the kernel resource report per architecture when the build stored one (`kernel_resources`,
  `build --arch`), with the CTAs per SM that registers and shared memory each allow;
- graph-pool memory and capture times once a GPU load recorded them (`graph_memory_bytes`,
  `runtime_load`), the Inductor compile seconds when the engine holds compiled steps
  (`compiled.compile_seconds`), and the step benchmark's numbers when the directory holds its
  `step.json` (benchmarks/step.py).

The page has no script and no external reference: inline CSS, inline SVG plots.
"""
from __future__ import annotations

import html
import json
from collections import Counter
from pathlib import Path
from dspark_compile.engine_dir.format import ArtifactError
from dspark_compile.engine_dir.paths import read_file
from dspark_compile.inspection import report_plots as plots
from dspark_compile.kernels.sm12x import ctas_by_registers, MAX_CTAS_PER_SM

STEP_JSON = "step.json"

# shared memory per SM and the part each CTA reserves (NVIDIA's CUDA programming guide, per
# compute capability): 9.0 has 228 KB per SM, 12.x 100 KB; 1 KB per CTA is the driver's
_SMEM_PER_SM = {"sm_90": 228 * 1024, "sm_120": 100 * 1024, "sm_121": 100 * 1024}
_SMEM_RESERVED_PER_CTA = 1024

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ccc}
h3{font-size:15px}table{border-collapse:collapse;margin:8px 0 16px;font-size:12.5px}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}figure{margin:8px 0}
figure svg{max-width:100%;height:auto}.none{color:#777;font-style:italic}
tr.bad td{background:#fde2e1}
"""


def _e(v) -> str:
    return html.escape("-" if v is None else str(v))


def _table(cols: list, rows: list, left: int = 1, bad=lambda r: False) -> str:
    head = "".join(f"<th{' class=l' if i < left else ''}>{_e(c)}</th>"
                   for i, c in enumerate(cols))
    body = []
    for r in rows:
        cells = "".join(f"<td{' class=l' if i < left else ''}>{_e(v)}</td>"
                        for i, v in enumerate(r))
        body.append(f"<tr{' class=bad' if bad(r) else ''}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _none(text: str) -> str:
    return f'<p class="none">{_e(text)}</p>'


_STEP_JSON_LIMIT = 16 << 20      # benchmarks/step.py writes a few kB


def program_op_counts(engine_dir: Path, rel: str, size: int | None = None):
    """{op: calls} of the `dspark::` ops in a stored program (its graph JSON's nodes,
    dspark_compile/engine_dir/graph_format.py), or None when its file cannot be read that way.
    The file is read through engine_dir/paths.py (inside the engine, no link, at most `size`
    bytes: its file-table size) and parsed as JSON, nothing else."""
    try:
        data = read_file(Path(engine_dir), rel, size if size is not None else 1 << 30)
        nodes = json.loads(data)["nodes"]
    except (ArtifactError, OSError, KeyError, TypeError, ValueError, RecursionError):
        return None
    if not isinstance(nodes, list) or not all(isinstance(n, dict) for n in nodes):
        return None
    prefix = "dspark."
    return dict(sorted(Counter(str(n["op"])[len(prefix):].split(".")[0] for n in nodes
                               if str(n.get("op", "")).startswith(prefix)).items()))


def _summary(engine_dir: Path, m: dict, loads_here: str) -> str:
    keys = ("dspark_compile_version", "torch_version", "triton_version", "cuda_version",
            "target_sm", "model_config_hash", "created_utc", "format_version")
    rows = [(k, m.get(k)) for k in keys] + [("buckets", m.get("buckets")),
                                            ("loads here", loads_here)]
    rows += [(f"build_config.{k}", json.dumps(v)) for k, v in
             sorted((m.get("build_config") or {}).items())]
    return f"<h1>dspark-compile engine report</h1><p>{_e(engine_dir.resolve())}</p>" + \
        _table(["field", "value"], rows, left=2)


_PASS_COLS = ("index", "name", "stage", "time_ms", "nodes_before", "nodes_after", "matches",
              "verified")


def _bucket(b: str, rows: list, ops, plots) -> str:
    fig = plots.waterfall(rows, f"bucket {b}: graph nodes after each pass")
    total = sum(r.get("time_ms") or 0 for r in rows)
    table = _table(list(_PASS_COLS), [
        [r.get(c) if c != "time_ms" else f"{r.get(c) or 0:.1f}" for c in _PASS_COLS]
        for r in rows], left=3)
    opt = (_table(["dspark:: op", "calls"], sorted(ops.items()))
           if ops else _none("the program file could not be read for its op counts"
                             if ops is None else "no dspark:: op in this program"))
    return (f'<section class="bucket" id="bucket-{_e(b)}"><h3>bucket {_e(b)}</h3>'
            f'<figure class="plot waterfall" data-bucket="{_e(b)}">{fig}<figcaption>node count '
            f'after each pass (total pass time {total:.1f} ms)</figcaption></figure>'
            f"{table}<h4>fused ops per kind</h4>{opt}</section>")


def _ctas(r: dict, arch: str) -> tuple:
    by_regs = ctas_by_registers(r["registers"], r["num_warps"]) if r.get("registers") else None
    smem = _SMEM_PER_SM.get(arch)
    by_smem = (min(MAX_CTAS_PER_SM, smem // (r["shared_bytes"] + _SMEM_RESERVED_PER_CTA))
               if smem and r.get("shared_bytes") is not None else None)
    both = [c for c in (by_regs, by_smem) if c is not None]
    return by_regs, by_smem, min(both) if both else None


def _kernels(m: dict) -> str:
    res = m.get("kernel_resources") or {}
    if not res:
        return "<h2>kernel resources</h2>" + _none("not in this engine (build --arch sm_120 "
                                                   "stores it)")
    out = ["<h2>kernel resources</h2>"]
    cols = ["op", "kernel", "warps", "constexprs", "registers", "shared B", "local B",
            "CTAs/SM (regs)", "CTAs/SM (smem)", "CTAs/SM", "ok"]
    for arch, records in sorted(res.items()):
        rows = [[r.get("op"), r.get("kernel"), r.get("num_warps"),
                 json.dumps(r.get("constexprs", {}), sort_keys=True), r.get("registers"),
                 r.get("shared_bytes"), r.get("local_bytes"), *_ctas(r, arch), r.get("ok")]
                for r in records]
        out.append(f'<h3 class="arch">{_e(arch)}</h3>'
                   + _table(cols, rows, left=4, bad=lambda row: row[-1] is False))
    return "".join(out)


def _runtime(m: dict) -> str:
    out = ["<h2>graph memory and load</h2>"]
    mem = {b: v for b, v in (m.get("graph_memory_bytes") or {}).items() if v is not None}
    load = m.get("runtime_load") or {}
    if not mem and not load:
        return out[0] + _none("not recorded yet (the first CUDA-graph load records them)")
    cap = load.get("capture_seconds", {})
    comp = load.get("compiled_load_seconds", {})
    rows = [[b, f"{mem[b] / 2**20:.2f}" if b in mem else None, cap.get(b), comp.get(b)]
            for b in sorted(set(mem) | set(cap), key=int)]
    out.append(_table(["bucket", "graph pool MiB", "capture s", "compiled load s"], rows,
                      left=0))
    if load:
        out.append(_table(["field", "value"], [(k, load.get(k)) for k in
                                               ("device", "torch_version", "load_seconds",
                                                "graph_pool_total_bytes")], left=2))
    return "".join(out)


def _compile(m: dict) -> str:
    secs = (m.get("compiled") or {}).get("compile_seconds")
    if not secs:
        return ""
    variants = sorted({v for per in secs.values() for v in per})
    rows = [[b, *[per.get(v) for v in variants]] for b, per in sorted(secs.items(),
                                                                     key=lambda kv: int(kv[0]))]
    total = (m.get("compiled") or {}).get("total_compile_seconds")
    return ("<h2>Inductor compile seconds</h2>" + _table(["bucket", *variants], rows, left=0)
            + (f"<p>total {_e(total)} s</p>" if total is not None else ""))


_STEP_COLS = ("case", "B", "variant", "status", "us_median", "us_p10", "us_p90",
              "launches_total", "launches_dspark", "ratio_to_floor")


def _step(engine_dir: Path, plots) -> str:
    path = engine_dir / STEP_JSON
    if not path.exists() and not path.is_symlink():
        return ""
    try:
        rec = json.loads(read_file(engine_dir, STEP_JSON, _STEP_JSON_LIMIT).decode("utf-8"))
        rows = list(rec.get("rows", []))
        if not all(isinstance(r, dict) for r in rows):
            raise TypeError("a row is not a table")
    except (ArtifactError, ValueError, AttributeError, TypeError, RecursionError) as e:
        return "<h2>step benchmark</h2>" + _none(f"{STEP_JSON} is not readable: {e}")
    env = rec.get("environment", {})
    head = ", ".join(f"{k} {env[k]}" for k in ("device", "torch", "triton", "git_commit",
                                               "date_utc") if env.get(k))

    def cell(r, c):
        v = r.get(c)
        return f"{v:.2f}" if isinstance(v, float) else v
    fig = ""
    if any(r.get("us_median") for r in rows):
        fig = f'<figure class="plot step">{plots.step_latency(rows)}</figure>'
    return (f"<h2>step benchmark</h2><p>{_e(head or 'no environment recorded')}"
            f"{' (dry run)' if rec.get('dry_run') else ''}</p>{fig}"
            + _table(list(_STEP_COLS), [[cell(r, c) for c in _STEP_COLS] for r in rows],
                     left=3))


def render_report(engine_dir, manifest: dict, loads_here: str = "") -> str:
    """The report page as one HTML string."""
    plots.check_matplotlib_available()
    engine_dir = Path(engine_dir)
    stats = manifest.get("pass_stats") or {}
    progs = manifest.get("programs") or {}
    files = manifest.get("files") or {}
    counts = {str(b): program_op_counts(engine_dir, progs[str(b)]["path"],
                                        files[progs[str(b)]["path"]]["size"])
              for b in manifest["buckets"]
              if str(b) in progs and progs[str(b)].get("path") in files}
    parts = [_summary(engine_dir, manifest, loads_here), "<h2>passes per bucket</h2>"]
    for b in manifest["buckets"]:
        rows = stats.get(str(b))
        parts.append(_bucket(str(b), rows, counts.get(str(b)), plots) if rows else
                     _none(f"bucket {b}: no pass statistics in the manifest"))
    readable = {b: c for b, c in counts.items() if c}
    if readable:
        parts.append('<h2>fused ops per kind</h2><figure class="plot fused">'
                     f"{plots.fused_ops_bars(readable)}</figure>")
    parts += [_kernels(manifest), _runtime(manifest), _compile(manifest),
              _step(engine_dir, plots)]
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>engine report: {_e(engine_dir.name)}</title><style>{_CSS}</style></head>"
            f"<body>{''.join(parts)}</body></html>\n")


def write_report(engine_dir, manifest: dict, out, loads_here: str = "") -> Path:
    out = Path(out)
    text = render_report(engine_dir, manifest, loads_here)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
