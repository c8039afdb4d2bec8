"""Property test of the HTTP API against the server's own OpenAPI document (schemathesis):
generated bodies, valid and invalid, never get a 5xx, and a body the schema rejects gets a
4xx. Bounded: a few dozen examples per operation and mode on the tiny model."""
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import negative_data_rejection, not_a_server_error

from tests.serve_util import tiny_server, wait_idle

EXAMPLES = 25


@pytest.fixture(scope="module")
def server():
    with tiny_server(k=3, max_batch=4, max_queue=64) as s:
        yield s


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_api_never_answers_5xx(server, mode):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions"}
    for op in operations:
        if mode == GenerationMode.NEGATIVE and (op.method.upper() != "POST" or not len(op.body)):
            continue  # a GET, or a POST that takes no body (/reset_prefix_cache), has no invalid input
        checks = [not_a_server_error] + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def run(case):
            case.call_and_validate(checks=checks, timeout=30)

        run()


def test_nothing_leaked_after_fuzzing(server):
    wait_idle(server.scheduler)
    assert server.scheduler.blocks.used == 0
    with server.client() as c:
        assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3}).status_code == 200
