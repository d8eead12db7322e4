"""`dspark-compile inspect ENGINE --report report.html` on the tiny engine (`small_engine`).

The page is checked as text (sections, numbers, nothing fetched from elsewhere) and in a real
headless Chromium (Debian's chromium-headless-shell or chromium, which .ci/run installs): a
wrapper page frames the report and measures every plot's rendered SVG. The optional fields
(kernel resources, graph memory, load and capture times, compile seconds, step.json) are
added to a copy of the engine, as a GPU load, `build --arch` and benchmarks/step.py write them.
"""
import html
import json
import re
import shutil
import subprocess
import sys

import pytest

from dspark_compile.engine_dir.write import update_manifest_field
from dspark_compile.cli.main import main

pytest.importorskip("matplotlib", reason="the 'report' extra is not installed")

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")

# one kernel configuration per arch: 128 registers x 4 warps allow 4 CTAs per SM
# (65536 / (128 * 32 * 4)); 40 KiB of shared memory allows 2 on sm_120 (100 KiB per SM,
# 1 KiB reserved per CTA) and 5 on sm_90 (228 KiB)
_KERNEL = {"op": "act_quant", "kernel": "_act_quant_kernel", "num_warps": 4,
           "constexprs": {"BLOCK": 128}, "registers": 128, "shared_static_bytes": 0,
           "shared_dynamic_bytes": 40960, "shared_bytes": 40960, "local_bytes": 0,
           "stack_bytes": 0}
_STEP = {"schema": 1, "dry_run": False, "environment": {"device": "NVIDIA H200",
                                                        "torch": "2.11.0+cu130"},
         "rows": [{"case": "greedy", "B": b, "variant": v, "status": "ok",
                   "us_median": us, "us_p10": us * 0.9, "us_p90": us * 1.1,
                   "launches_total": 300, "launches_dspark": 90, "ratio_to_floor": 3.0}
                  for b, v, us in ((1, "engine", 811.5), (2, "engine", 902.25),
                                   (1, "eager", 30500.0))]}


def _render(engine, out):
    return main(["inspect", str(engine), "--report", str(out)])


@pytest.fixture(scope="module")
def plain(small_engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "plain.html"
    assert _render(small_engine.path, out) == 0
    return out.read_text()


@pytest.fixture(scope="module")
def recorded(small_engine, tmp_path_factory):
    """A copy of the engine with every optional field recorded, and its report."""
    eng = tmp_path_factory.mktemp("report_rec") / "engine"
    shutil.copytree(small_engine.path, eng)
    update_manifest_field(eng, "kernel_resources", {
        "sm_120": [dict(_KERNEL, arch="sm_120", ok=True)],
        "sm_90": [dict(_KERNEL, arch="sm_90", ok=True)]})
    update_manifest_field(eng, "graph_memory_bytes", {"1": 3 * 2**20, "2": 5 * 2**20})
    update_manifest_field(eng, "runtime_load", {
        "device": "NVIDIA H200", "torch_version": "2.11.0+cu130", "load_seconds": 12.5,
        "capture_seconds": {"1": 0.8125, "2": 0.9375}, "compiled_load_seconds": {},
        "graph_pool_total_bytes": 8 * 2**20})
    update_manifest_field(eng, "compiled", {"programs": {}, "total_compile_seconds": 401.0,
                                            "compile_seconds": {"1": {"full": 200.5},
                                                                "2": {"full": 200.5}}})
    (eng / "step.json").write_text(json.dumps(_STEP))
    out = eng.parent / "report.html"
    assert _render(eng, out) == 0
    return out


def test_report_holds_a_waterfall_per_bucket_and_the_pass_table(plain, small_engine):
    assert plain.count('<figure class="plot waterfall"') == len(small_engine.manifest["buckets"])
    for b in (1, 2):
        assert f'<figure class="plot waterfall" data-bucket="{b}"><svg' in plain
    for row in small_engine.manifest["pass_stats"]["1"]:
        assert f"<td class=l>{row['name']}</td>" in plain
    assert '<figure class="plot fused">' in plain and "<td class=l>rmsnorm_quant</td>" in plain
    for section in ("kernel resources", "graph memory and load"):
        assert f"<h2>{section}</h2>" in plain
    assert "not recorded yet" in plain and "build --arch sm_120" in plain
    assert "step benchmark" not in plain and "Inductor compile seconds" not in plain


def test_report_is_self_contained(plain):
    assert "<script" not in plain and "<link" not in plain and "src=" not in plain
    assert "@import" not in plain
    # the SVGs' own references (clip paths, glyphs) point inside the page
    refs = re.findall(r'href="([^"]*)"', plain) + re.findall(r"url\(([^)]*)\)", plain)
    assert refs and all(r.startswith("#") for r in refs), [r for r in refs if r[:1] != "#"]


def test_report_shows_the_recorded_fields(recorded):
    page = recorded.read_text()
    for arch in ("sm_120", "sm_90"):
        assert f'<h3 class="arch">{arch}</h3>' in page
    # registers 4, shared memory 2 (sm_120) and 5 (sm_90); the least of them is the CTAs/SM
    assert "<td>128</td><td>40960</td><td>0</td><td>4</td><td>2</td><td>2</td>" in page
    assert "<td>128</td><td>40960</td><td>0</td><td>4</td><td>5</td><td>4</td>" in page
    assert "<td>1</td><td>3.00</td><td>0.8125</td>" in page     # graph pool MiB, capture s
    assert "<td>2</td><td>5.00</td><td>0.9375</td>" in page
    assert "<h2>Inductor compile seconds</h2>" in page and "total 401.0 s" in page
    assert "NVIDIA H200" in page and "<td>811.50</td>" in page and "<td>902.25</td>" in page
    assert '<figure class="plot step">' in page


def _browser():
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


_WRAPPER = """<!DOCTYPE html><html><body><pre id="result">pending</pre>
<iframe id="f" src="%s" width="1250" height="900"></iframe><script>
document.getElementById("f").addEventListener("load", function () {
  var d = this.contentDocument, out = {title: d.title, figures: []};
  d.querySelectorAll("figure.plot").forEach(function (f) {
    var svg = f.querySelector("svg"), r = svg ? svg.getBoundingClientRect() : null;
    out.figures.push({cls: f.className, bucket: f.dataset.bucket || null,
                      width: r ? r.width : 0, height: r ? r.height : 0,
                      paths: svg ? svg.querySelectorAll("path").length : 0});
  });
  document.getElementById("result").textContent = JSON.stringify(out);
});</script></body></html>
"""


def test_report_renders_in_headless_chromium(recorded, small_engine):
    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium here (apt-get install chromium-headless-shell; .ci/run does)")
    wrapper = recorded.parent / "wrapper.html"
    wrapper.write_text(_WRAPPER % recorded.name)
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                           "--allow-file-access-from-files", "--virtual-time-budget=10000",
                           "--dump-dom", wrapper.as_uri()],
                          capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="result">([^<]*)</pre>', proc.stdout)
    assert found, (proc.returncode, proc.stderr[-2000:])
    res = json.loads(html.unescape(found.group(1)))
    assert res["title"] == "engine report: engine"
    falls = [f for f in res["figures"] if "waterfall" in f["cls"]]
    assert sorted(f["bucket"] for f in falls) == [str(b) for b in small_engine.manifest["buckets"]]
    assert {f["cls"] for f in res["figures"]} == {"plot waterfall", "plot fused", "plot step"}
    for f in res["figures"]:      # drawn: a laid-out SVG with the bars and text as paths
        assert f["width"] > 300 and f["height"] > 200 and f["paths"] > 20, f


def test_missing_matplotlib_names_the_extra(small_engine, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert _render(small_engine.path, tmp_path / "r.html") == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["dspark-compile inspect: error: --report needs matplotlib: pip install "
                     "'dspark-compile[report]'"]
    assert not (tmp_path / "r.html").exists()
