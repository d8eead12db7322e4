"""benchmarks/serve_load.py --dry-run on the CPU, over the session's small engine: every level's
engine and server numbers, the server's tokens equal to the engine's, the JSON, CSV and plot."""
import csv
import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_tool():
    spec = importlib.util.spec_from_file_location("serve_load", REPO / "benchmarks" /
                                                  "serve_load.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def assert_itl(row: dict, side: str) -> None:
    """ITL p50 <= p99, both > 0. The server's may be absent: a stream behind its engine sends
    the steps waiting as one chunk (serve/http.py Run._coalesce), so a 4-token request of the
    dry run may arrive in one delivery, which has no gap to time. The engine's never is (it
    reads every step)."""
    p50, p99 = row[f"{side}_itl_p50_ms"], row[f"{side}_itl_p99_ms"]
    if side == "server" and p50 is None:
        assert p99 is None
        return
    assert 0 < p50 <= p99


def test_dry_run_reports_every_level_and_the_servers_tokens_match(small_engine, small_loaded,
                                                                   tmp_path):
    tool = load_tool()
    args = tool._args(["--dry-run", "--engine", str(small_engine.path), "--out", str(tmp_path)])
    rec = tool.run(args, eng=small_loaded, log=lambda line: None)
    saved = json.loads((tmp_path / "serve_load.json").read_text())
    assert saved["schema"] == "dspark-serve-load-benchmark/1" and saved["complete"]
    assert saved["rows"] == json.loads(json.dumps(rec["rows"]))
    assert [r["concurrency"] for r in rec["rows"]] == [1, 2]
    for r in rec["rows"]:
        c = r["concurrency"]
        assert r["requests"] == c * args.rounds
        # eos ignored: every request runs to max_tokens on both sides
        assert r["engine_tokens"] == r["server_tokens"] == c * args.rounds * args.max_tokens
        assert r["tokens_match"] is True and r["generate_tokens_match"] is True
        assert r["generate_tokens"] == r["engine_tokens"] and r["generate_tokens_per_s"] > 0
        for side in ("engine", "server"):
            assert r[f"{side}_tokens_per_s"] > 0
            assert_itl(r, side)
            assert 0 < r[f"{side}_ttft_p50_ms"] <= r[f"{side}_ttft_p99_ms"]
        assert r["overhead_pct"] == round(100 * (1 - r["server_tokens_per_s"]
                                                 / r["engine_tokens_per_s"]), 2)
        assert r["overhead_vs_generate_pct"] == round(100 * (1 - r["server_tokens_per_s"]
                                                             / r["generate_tokens_per_s"]), 2)
    with open(tmp_path / "serve_load.csv") as f:
        assert [int(r["concurrency"]) for r in csv.DictReader(f)] == [1, 2]
    assert (tmp_path / "serve_load.png").stat().st_size > 0
    # the engine went back closed: the next stream opens
    small_loaded.open_stream().close()


def test_chat_dry_run_runs_the_servers_rendered_ids_on_every_side(small_engine, small_loaded,
                                                                 tmp_path):
    """--chat: the engine sides run the ids serve/chat.py renders for each request's message
    (the engine's tokenizer.json and tokenizer_config.json, the trained tiny model's), and the
    server's chat stream (text, usage) equals the engine's output on them."""
    from dspark_compile.serve.chat import chat_of, prompt_ids
    tool = load_tool()
    args = tool._args(["--dry-run", "--chat", "--engine", str(small_engine.path), "--out",
                       str(tmp_path)])
    rec = tool.run(args, eng=small_loaded, log=lambda line: None)
    saved = json.loads((tmp_path / "serve_load.json").read_text())
    assert saved["endpoint"] == "chat" and saved["complete"]
    # the prompts are the rendered conversations: the format's tokens around the message
    chat = tool.Chat(small_loaded)
    tok = chat.tokenizer
    reqs = chat.render(args, tool.workload(args, small_loaded.cfg.vocab_size, 2))
    for r in reqs:
        assert r["prompt"] == prompt_ids(chat_of(tool.request_body(args, "bench", r)),
                                         chat.state)
        assert len(r["prompt"]) > len(tok.encode(r["messages"][0]["content"]))
    lens = saved["chat_prompt_tokens"]
    assert 0 < lens["min"] <= lens["mean"] <= lens["max"]
    for r in rec["rows"]:
        c = r["concurrency"]
        assert r["engine_tokens"] == r["server_tokens"] == c * args.rounds * args.max_tokens
        assert r["tokens_match"] is True and r["generate_tokens_match"] is True
        assert_itl(r, "server")
        assert 0 < r["server_ttft_p50_ms"] <= r["server_ttft_p99_ms"]
    small_loaded.open_stream().close()


def test_chat_without_a_tokenizer_is_one_line_before_the_engine_loads(tmp_path):
    """An engine directory without tokenizer.json (an empty one here: refused before it is
    loaded, which would fail otherwise)."""
    tool = load_tool()
    (tmp_path / "engine").mkdir()
    args = tool._args(["--dry-run", "--chat", "--engine", str(tmp_path / "engine"), "--out",
                       str(tmp_path / "out")])
    try:
        tool.run(args, log=lambda line: None)
    except SystemExit as e:
        msg = str(e.code)
    else:
        raise AssertionError("--chat ran without a tokenizer")
    assert msg.startswith("--chat:") and "tokenizer.json" in msg and "\n" not in msg
