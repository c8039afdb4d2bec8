"""Prefix-affine routing for `python -m forerun.serve.ray_app --routing prefix` (the default): a
request goes to the replica that holds its prefix, so a session's turns keep hitting that
replica's prefix cache (vLLM's production router and llm-d route by KV cache the same way).

Ray Serve's HTTP proxy hands a router no body, so a small front deployment reads it, computes
the request's routing key, and passes key and body to the replicas through a deployment
handle; `PrefixRouter` (a Ray Serve RequestRouter) ranks the replicas for that key by
rendezvous hashing: every router instance agrees without shared state, and a replica that
joins or leaves moves only its own share of the keys. A replica at its `max_ongoing_requests`
passes the request to the next in the key's ranking.

The key (OpenAI's `prompt_cache_key`, else a hash of the session's opening messages or prompt)
and the ranking: serve/routing_key.py, which imports no Ray.
"""
from __future__ import annotations

import asyncio

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from forerun.serve.routing_key import ranking, routing_key


class PrefixRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.args[0] if pending_request is not None and pending_request.args else ""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i]] for i in ranking(key, list(by_id))]


class Front:
    """The HTTP ingress: reads the body, routes by its key, streams the replica's answer back."""

    def __init__(self, replicas):
        self.replicas = replicas

    async def __call__(self, request):
        from starlette.responses import StreamingResponse

        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("content-length", "host")]
        answer = self.replicas.options(stream=True).handle.remote(routing_key(body), request.method, path, headers, body)
        head = await answer.__anext__()

        async def rest():
            async for chunk in answer:
                yield chunk

        return StreamingResponse(rest(), status_code=head["status"], headers=dict(head["headers"]))


class Replica:
    """One forerun server (model, scheduler, app), answering the front's requests in process."""

    def __init__(self, args):
        from forerun.serve.replica import build_replica_app

        self.app = build_replica_app(args)
        self.app.state.scheduler.start()  # (what the app's lifespan does under uvicorn)

    async def handle(self, key: str, method: str, path: str, headers: list, body: bytes):
        """The app's answer: first {"status", "headers"}, then the body's chunks (bytes)."""
        raw, _, query = path.partition("?")
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
                 "path": raw, "raw_path": raw.encode(), "query_string": query.encode(), "root_path": "",
                 "headers": [(k.encode().lower(), v.encode()) for k, v in headers], "client": ("127.0.0.1", 0),
                 "server": ("127.0.0.1", 80)}
        out: asyncio.Queue = asyncio.Queue()
        sent = asyncio.Event()

        async def receive():
            if not sent.is_set():
                sent.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # no disconnect from here: the front's stream carries it

        task = asyncio.create_task(self.app(scope, receive, out.put))
        try:
            while True:
                msg = await out.get()
                if msg["type"] == "http.response.start":
                    yield {"status": msg["status"], "headers": [(k.decode(), v.decode()) for k, v in msg.get("headers", [])
                                                                if k.lower() != b"content-length"]}
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body"):
                        break
            await task
        finally:
            task.cancel()  # a client gone: the app's stream stops, and so does its request
