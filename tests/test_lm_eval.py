"""lm-eval (EleutherAI's lm-evaluation-harness) against `forerun serve`, end to end, with the
example tasks in examples/lm_eval: the log-likelihood task through local-completions (echo +
logprobs, the server's /tokenize for its tokenizer) and the generation task through
local-chat-completions, each with and without speculation: the same scores and the same
per-sample values. Skips where lm_eval is not installed (pip install 'lm-eval[api]')."""
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is an optional extra: pip install 'lm-eval[api]'")

from forerun.config import SpeculativeConfig  # noqa: E402
from forerun.llm import LLM  # noqa: E402
from forerun.serve.main import build_server  # noqa: E402
from forerun.serve.scheduler import ServeConfig  # noqa: E402
from tests.serve_util import Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def llm():
    return LLM(NAME, progress=False)


def _evaluate(llm, spec, model: str, task: str, path: str, **kw) -> dict:
    from lm_eval.tasks import TaskManager

    app = build_server(llm, spec, ServeConfig(max_batch=2, max_len=512), default_max_tokens=32, names=(NAME,))
    with Server(app) as server:
        return lm_eval.simple_evaluate(
            model=model, model_args=f"model={NAME},base_url={server.url}{path},num_concurrent=1,max_retries=1",
            tasks=[task], task_manager=TaskManager(include_path=str(ROOT / "examples" / "lm_eval")), limit=4,
            log_samples=True, batch_size=1, **kw)


def _samples(results: dict, task: str) -> list:
    return [s["resps"] for s in results["samples"][task]]


@pytest.fixture(autouse=True)
def _offline_from_the_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to it
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_loglikelihood_task_through_local_completions(llm):
    task = "forerun_capitals"
    spec = _evaluate(llm, SpeculativeConfig("ngram", 4), "local-completions", task, "/v1/completions")
    plain = _evaluate(llm, None, "local-completions", task, "/v1/completions")
    assert spec["results"][task]["acc,none"] == plain["results"][task]["acc,none"] >= 0.5
    assert _samples(spec, task) == _samples(plain, task)  # every choice's log-likelihood, equal


def test_generation_task_through_local_chat_completions(llm):
    task = "forerun_arithmetic"
    kw = dict(apply_chat_template=True)
    spec = _evaluate(llm, SpeculativeConfig("ngram", 4), "local-chat-completions", task, "/v1/chat/completions", **kw)
    plain = _evaluate(llm, None, "local-chat-completions", task, "/v1/chat/completions", **kw)
    key = "exact_match,last-number"
    assert spec["results"][task][key] == plain["results"][task][key]
    assert _samples(spec, task) == _samples(plain, task) and all(r[0][0] for r in _samples(plain, task))
