"""Two forerun replicas behind one Ray Serve endpoint, on this machine, started from
`python -m forerun.serve.ray_app`'s own options (the embedded SmolLM2, ngram k 3, a served name):
both replicas run, the served name answers, the server speculates, and greedy output, streamed
or not, whichever replica served it, is plain decoding's in this process. ray[serve] is in the
test extra.
(test_ray_app.py checks the launcher's options and that Ctrl-C stops the cluster it started.)"""
import socket

import openai
import pytest
import ray
from ray import serve

from forerun.config import SamplingParams
from forerun.llm import LLM
from forerun.serve.ray_app import application, build_parser

NAME = "smollm2-ray"
PROMPT = "1 2 3 4 1 2 3 4 1 2 3 4 1 2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def plain() -> str:
    """The greedy text in this process, plain. Loading the model here also fetches it, or builds
    stale kernels, once, not in both replicas at the same time."""
    (out,) = LLM(progress=False).generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), speculative=None)
    return out.text


@pytest.fixture(scope="module")
def endpoint(plain):
    port = _free_port()
    args = build_parser().parse_args(["--replicas", "2", "--threads", "1", "--port", str(port), "--method", "ngram",
                                      "--k", "3", "--max-batch", "2", "--max-len", "256", "--served-name", NAME])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application(args))
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_serve_one_endpoint(endpoint, plain):
    client = openai.OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    outs = [client.completions.create(**kw) for _ in range(4)]
    assert [o.choices[0].text for o in outs] == [plain] * 4  # whichever replica answered
    assert all(o.model_extra["forerun"]["drafted"] > 0 for o in outs)  # --method ngram --k 3 reached the replicas
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == plain
    status = serve.status().applications["default"].deployments["forerun"]
    assert status.replica_states.get("RUNNING") == 2


def test_prefix_routing_keeps_a_sessions_turns_on_the_replica_that_holds_them(endpoint):
    """--routing prefix (the default): every later turn of a session reads its cached prefix,
    whichever of the two replicas holds it (random routing would miss half the time)."""
    client = openai.OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0, timeout=60)
    for s in range(4):
        messages = [{"role": "system", "content": f"Session {s}. " + "You answer briefly and exactly. " * 6},
                    {"role": "user", "content": "Count from one to five."}]
        first = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And back down."}]
        second = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - 16, (s, cached, first.usage.prompt_tokens)
