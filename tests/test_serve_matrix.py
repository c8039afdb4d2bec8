"""The serve matrix without real models: its table and identity logic on canned cells, the
command lines it starts servers with, the subprocess launcher, and one measured cell against
the tiny in-thread server (a real load: identity, KV blocks back to 0, acceptance)."""
import doctest
import json
import sys
import textwrap

import pytest

from forerun.bench import launch
from forerun.bench import loadgen
from forerun.bench import matrix
from forerun.bench import matrix_cells
from forerun.bench import matrix_report
from forerun.bench.llama_peer import LlamaSetup, find_llama_server, llama_argv, llama_configs
from tests.serve_util import tiny_server


@pytest.mark.parametrize("module", [loadgen, matrix_report, matrix_cells])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def cell(engine, config, clients, tps, same=2, of=2, kv=(0, 5, 0, 40)):
    kv_fields = dict(zip(("kv_before", "kv_peak", "kv_after", "kv_total"), kv if kv else (None,) * 4))
    return {"engine": engine, "config": config, "clients": clients, "tok_per_s": tps, "p50_s": 1.0, "p95_s": 2.0,
            "ttft_p50_s": 0.1, "identity": {"same": same, "of": of, "differ": []}, "acceptance": 0.5 if kv else None,
            **kv_fields}


def test_tables_put_each_server_in_a_column_and_leave_missing_cells_blank():
    cells = [cell("forerun", "off", 1, 17.0), cell("forerun", "off", 4, 40.0), cell("llama-server", "plain", 4, 90.0, kv=None)]
    pivot = matrix_report.throughput_table(cells).splitlines()
    assert pivot[0] == "| clients | forerun off | llama-server plain |"
    assert pivot[2] == "| 1 | 17.0 (1.00 / 2.00) |  |"
    assert pivot[3] == "| 4 | 40.0 (1.00 / 2.00) | 90.0 (1.00 / 2.00) |"
    detail = matrix_report.detail_table(cells).splitlines()
    assert detail[2] == "| forerun off | 1 | 17.0 | 1.00 | 2.00 | 0.10 | 2/2 | 0 / 5 / 0 of 40 | 50% |"
    assert detail[4].endswith("| 2/2 | n/a |  |")


def test_identity_names_each_request_that_parts_from_its_prompt_alone():
    alone = {0: "def area(w, h):", 1: "apple\nbanana"}
    records = [{"prompt": 0, "text": "def area(w, h):"}, {"prompt": 1, "text": "apple\nbanana"},
               {"prompt": 1, "text": "apple\ncherry"}, {"prompt": 0, "text": "def area(w, h):\n"}]
    got = matrix_report.identity(records, alone)
    assert (got["same"], got["of"]) == (2, 4)
    assert got["differ"] == [{"prompt": 1, "at_char": 6}, {"prompt": 0, "at_char": 15}]


def test_percentile_and_summary_on_canned_latencies():
    records = [{"latency": float(i), "ttft": 0.5, "tokens": 8} for i in range(1, 21)]
    s = loadgen.summarize(records, wall=10.0)
    assert (s["p50_s"], s["p95_s"], s["tok_per_s"], s["requests"]) == (10.5, 19.0, 16.0, 20)


def test_forerun_servers_differ_only_in_their_speculation_flags():
    args = matrix.parse_args(["--model", "qwen2.5-coder-1.5b", "--draft-model", "qwen2.5-coder-0.5b", "--method",
                              "draft_model", "--dtype", "int8", "--draft-dtype", "int4", "--k", "4", "--clients", "1,8",
                              "--forerun-args", "--block-size 32"])
    fixed, aware, off = (matrix_cells.forerun_argv(args, c, 9000) for c in ("fixed", "batch-aware", "off"))
    assert fixed[:4] == [sys.executable, "-m", "forerun.cli", "serve"]
    assert fixed[fixed.index("--max-batch") + 1] == "8" and fixed[-2:] == ["--block-size", "32"]
    assert "--no-batch-aware" in fixed and "--no-batch-aware" not in aware
    assert set(fixed) - set(aware) == {"--no-batch-aware"}
    assert off[off.index("--method") + 1] == "none" and "--draft-model" not in off
    assert aware[aware.index("--draft-dtype") + 1] == "int4" and aware[aware.index("--k") + 1] == "4"
    assert matrix.parse_args(["--method", "none"]).configs == ["off"]
    with pytest.raises(SystemExit):
        matrix.parse_args(["--configs", "fixed,turbo"])


def test_llama_server_command_lines(tmp_path):
    setup = LlamaSetup(tmp_path / "llama-server", tmp_path / "m.gguf", threads=2, ctx_per_slot=1024, k=5,
                       draft_gguf=tmp_path / "d.gguf", extra=("--seed", "1"))
    plain = llama_argv(setup, "plain", 4, 8080)
    assert plain[plain.index("--parallel") + 1] == "4" and plain[plain.index("-c") + 1] == "4096"
    assert plain[plain.index("-t") + 1] == "2" and "--spec-type" not in plain and plain[-2:] == ["--seed", "1"]
    draft = llama_argv(setup, "draft", 1, 8080)
    assert draft[draft.index("-md") + 1] == str(tmp_path / "d.gguf") and draft[draft.index("--spec-draft-n-max") + 1] == "5"
    assert draft[draft.index("--spec-type") + 1] == "draft-simple"
    ngram = llama_argv(setup, "ngram", 1, 8080)
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-simple" and ngram[ngram.index("--spec-ngram-simple-size-m") + 1] == "5"
    assert llama_configs("draft_model", True) == ["plain", "draft"] and llama_configs("draft_model", False) == ["plain"]
    assert llama_configs("ngram", False) == ["plain", "ngram"] and llama_configs("layer_skip", False) == ["plain"]


def test_find_llama_server_takes_the_binary_or_its_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("FORERUN_LLAMA_CPP_BIN", raising=False)
    assert find_llama_server(None) is None and find_llama_server(str(tmp_path)) is None
    (tmp_path / "llama-server").write_text("")
    assert find_llama_server(str(tmp_path)) == find_llama_server(str(tmp_path / "llama-server")) == tmp_path / "llama-server"
    monkeypatch.setenv("FORERUN_LLAMA_CPP_BIN", str(tmp_path))
    assert find_llama_server(None) == tmp_path / "llama-server"


HEALTH_SERVER = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a): pass
    try:
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    except KeyboardInterrupt:
        print("stopped cleanly")
""")


def test_launched_waits_for_health_and_stops_with_sigint(tmp_path):
    import httpx

    port = launch.free_port()
    server = launch.Launched([sys.executable, "-c", HEALTH_SERVER, str(port)], port, tmp_path / "s.log", timeout=30)
    with server as url:
        assert httpx.get(url + "/health").status_code == 200
    assert server.proc.returncode == 0 and "stopped cleanly" in (tmp_path / "s.log").read_text()


def test_launched_stops_with_sigint_from_a_launcher_that_ignores_it(tmp_path):
    """A launcher run as `cmd &` from a script has SIGINT ignored; its server must still hear it."""
    import signal

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        port = launch.free_port()
        server = launch.Launched([sys.executable, "-c", HEALTH_SERVER, str(port)], port, tmp_path / "s.log", timeout=30)
        with server:
            pass
        assert server.proc.returncode == 0 and "stopped cleanly" in (tmp_path / "s.log").read_text()
    finally:
        signal.signal(signal.SIGINT, before)


def test_launched_reports_a_server_that_dies_with_its_log(tmp_path):
    port = launch.free_port()
    argv = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*no such model"):
        with launch.Launched(argv, port, tmp_path / "s.log", timeout=30):
            pass


def test_a_measured_cell_on_the_tiny_server(tmp_path):
    args = matrix.parse_args(["--clients", "3", "--per-client", "2", "--max-tokens", "8", "--out", str(tmp_path)])
    with tiny_server(k=3, max_batch=4, max_len=512) as s:
        alone = matrix_cells.alone_texts(s.url, args, {})
        assert sorted(alone) == [0, 1, 2, 3]  # clients 0..2 x requests 0..1 reach prompts 0..3
        c = matrix_cells.measure(s.url, 3, args, alone, {}, forerun=True)
    assert c["requests"] == 6 and c["tokens"] > 0 and c["identity"]["same"] == 6
    assert c["kv_before"] == c["kv_after"] == 0 and c["kv_total"] > 0 and c["kv_peak"] is not None
    report = matrix.Report(tmp_path, "tiny", {})
    report.add({"engine": "forerun", "config": "fixed k=3", **c})
    report.failures.append("llama plain: did not start")
    saved = json.loads((tmp_path / "matrix.json").read_text())
    assert saved["cells"][0]["identity"]["same"] == 6
    report.write()
    assert "| forerun fixed k=3 | 3 |" in (tmp_path / "matrix.md").read_text()
    assert "- failed: llama plain: did not start" in (tmp_path / "matrix.md").read_text()


def test_a_llama_server_style_stream_is_read_like_forerun_s():
    """Content deltas, then (include_usage) a last chunk with empty choices, usage and llama.cpp's timings."""
    import asyncio

    import httpx

    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
              {"choices": [{"index": 0, "delta": {"content": "def area"}}]},
              {"choices": [{"index": 0, "delta": {"content": "(w, h):"}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"completion_tokens": 5}, "timings": {"draft_n": 8, "draft_n_accepted": 6}}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    def handler(request):
        body = json.loads(request.content)
        assert body["temperature"] == 0 and body["cache_prompt"] is False and body["stream_options"]["include_usage"]
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(base_url="http://peer", transport=httpx.MockTransport(handler)) as client:
            return await loadgen.one(client, 2, 5, matrix_cells.LLAMA_BODY)

    r = asyncio.run(go())
    assert (r["prompt"], r["text"], r["tokens"], r["drafted"], r["accepted"]) == (2, "def area(w, h):", 5, 8, 6)
