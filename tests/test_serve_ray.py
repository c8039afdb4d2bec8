"""Two forerun replicas behind one Ray Serve endpoint, on this machine. Both replicas answer,
streaming works through Ray's proxy, and greedy output is the same whichever replica served it.

ray is not in the test extra (it is large), so this file skips unless it is installed; to run it:
    .venv/bin/pip install 'ray[serve]>=2.9' && .venv/bin/python -m pytest tests/test_serve_ray.py
(test_ray_app.py, which needs no ray, checks that Ctrl-C stops the cluster the app started.)"""
import socket

import pytest

RUN_IT = "ray is not installed: .venv/bin/pip install 'ray[serve]>=2.9', then pytest tests/test_serve_ray.py"
ray = pytest.importorskip("ray", reason=RUN_IT)
serve = pytest.importorskip("ray.serve", reason=RUN_IT)
openai = pytest.importorskip("openai")

from forerun.serve.ray_app import application  # noqa: E402
from tests.serve_util import NAME, tiny_llm  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint():
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"working_dir": None})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(tiny_llm, replicas=2, method="ngram", k=3, max_batch=4, max_len=256, names=(NAME,)))
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_serve_one_endpoint(endpoint):
    client = openai.OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=NAME, prompt="abcabcabc", max_tokens=16, temperature=0)
    texts = {client.completions.create(**kw).choices[0].text for _ in range(8)}
    assert len(texts) == 1  # same weights (seeded), greedy: whichever replica answered
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == texts.pop()
    status = serve.status().applications["default"].deployments["forerun"]
    assert status.replica_states.get("RUNNING") == 2
