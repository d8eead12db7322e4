"""SIGTERM with requests in flight (issue 50, item 4), against a server in its own process
(tests/serve/fake_serve.py: the stand-in stream, each step 0.1 s): new requests and /health get
503 while it drains; a request that finishes within --drain-timeout ends normally; one that
cannot ends with OpenAI's error body (JSON) or an error event and `data: [DONE]` (stream); the
log holds no traceback; the process exits 143."""
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from serve.serve_helpers import start_stream

HERE = Path(__file__).resolve().parent
STEP_S = 0.1       # each step commits 1..3 tokens: 12 take 0.4 to 1.2 s, 150 at least 5 s
DRAIN_S = 3.0


def get(url, path):
    try:
        with urllib.request.urlopen(url + path, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def read_stream(sock) -> list:
    got = b""
    while True:
        more = sock.recv(65536)
        if not more:
            break
        got += more
    sock.close()
    # the events of a chunked body: each `data: ...` line (a chunk-size line precedes each)
    return [line[6:] for line in got.decode().splitlines() if line.startswith("data: ")]


def test_sigterm_drains_then_ends_what_is_left_with_error_bodies(tmp_path):
    proc = subprocess.Popen([sys.executable, str(HERE / "fake_serve.py"), str(tmp_path),
                             "--step-s", str(STEP_S), "--drain-timeout", str(DRAIN_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"serving m on (http://127\.0\.0\.1:\d+)", line):
                break
        assert m, "".join(lines)
        url = m.group(1)
        short = {"model": "m", "prompt": [5], "max_tokens": 12, "ignore_eos": True,
                 "stream": True}
        long = {"model": "m", "prompt": [6], "max_tokens": 150, "ignore_eos": True}
        s_long, _ = start_stream(url, {**long, "stream": True})
        json_long = []
        t = threading.Thread(target=lambda: json_long.append(post(url, long)))
        t.start()
        deadline = time.monotonic() + 30
        while json.loads(get(url, "/health")[1]).get("in_flight") != 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        s_short, _ = start_stream(url, short)        # its first tokens came: it is running
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        deadline = t0 + 30
        while get(url, "/health")[0] != 503:       # the drain has begun
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, text = get(url, "/health")
        assert status == 503 and "shutting down" in json.loads(text)["error"]["message"]
        status, text = post(url, {"model": "m", "prompt": [5], "max_tokens": 1})
        assert status == 503 and json.loads(text)["error"]["type"] == "service_unavailable"
        short_events, long_events = read_stream(s_short), read_stream(s_long)
        t.join(60)
        # the short one finished within the drain: its last chunk has its finish reason
        assert short_events[-1] == "[DONE]"
        assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        assert not any("\"error\"" in e for e in short_events)
        # the long ones could not: an error event then [DONE]; the JSON one an error body
        assert long_events[-1] == "[DONE]"
        err = json.loads(long_events[-2])["error"]
        assert err["type"] == "service_unavailable" and "--drain-timeout 3 s" in err["message"]
        status, text = json_long[0]
        assert status == 503 and "--drain-timeout 3 s" in json.loads(text)["error"]["message"]
        rest = proc.communicate(timeout=60)[0]
        assert time.monotonic() - t0 >= DRAIN_S - 0.5
        log = "".join(lines) + rest
        assert proc.returncode == 143, log
        assert "Traceback" not in log and "CancelledError" not in log, log
        assert "shutting down: 3 requests in flight" in log
        assert "2 requests still in flight are ended with an error" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
