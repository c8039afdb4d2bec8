"""The FastAPI app: OpenAI routes over a Scheduler, errors as OpenAI JSON with 4xx codes."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from forerun.serve.admission import ApiError, Limits, build_request, check_model, compile_structured, k_note, prompt_ids
from forerun.serve.auth import ApiKeys, guarded
from forerun.serve.chat_turn import chat_turn
from forerun.serve.metrics import ServeMetrics
from forerun.serve.request import Event, ServeRequest
from forerun.serve.responses import DONE, Echo, Shape, sse
from forerun.serve.scheduler import QueueFull, Scheduler, TooLarge
from forerun.serve.responses_api import ResponseShape, ResponsesRequest, from_chat, to_chat
from forerun.serve.responses_api import events as response_events
from forerun.serve.schemas import ChatRequest, CompletionRequest, StreamOptions
from forerun.serve.tokenize_routes import add_tokenizer_routes

log = logging.getLogger("forerun.serve")
DISCONNECT_POLL_S = 0.25
_SAID: set[str] = set()  # unused OpenAI fields already named in the log  # how often a non-streaming request checks that its client is still there
ERRORS = {s: {"description": d} for s, d in [(400, "invalid request"), (401, "missing or incorrect API key (when the "
                                              "server has keys)"), (404, "unknown model"), (429, "queue full")]}


def build_app(llm, scheduler: Scheduler, limits: Limits, metrics: ServeMetrics, keys: ApiKeys = ApiKeys()) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="forerun", version="0.1.0", lifespan=lifespan)
    app.state.llm, app.state.scheduler, app.state.limits, app.state.metrics = llm, scheduler, limits, metrics
    app.state.keys = keys
    _add_error_handlers(app, metrics)
    _add_key_check(app, keys, metrics)

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        try:
            prompt = body.single_prompt()
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from e
        return await _generate(request, body, prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat(body: ChatRequest, request: Request):
        check_model(body, limits)
        turn = chat_turn(llm, body)
        grammar = None
        if turn.tools:
            grammar = await asyncio.get_running_loop().run_in_executor(None, turn.compile, llm)
        return await _generate(request, body, turn.prompt, body.limit(), chat=True, grammar=grammar, tools=bool(turn.tools))

    @app.post("/v1/responses", responses=ERRORS)
    async def responses(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API, decoded as the chat request it amounts to (responses_api.py)."""
        as_chat = to_chat(body)
        if body.stream:
            as_chat = as_chat.model_copy(update={"stream": True, "stream_options": StreamOptions(include_usage=True)})
        shape = ResponseShape(limits.model_names[0], body)
        reply = await chat(as_chat, request)
        if body.stream:
            return StreamingResponse(response_events(shape, reply.body_iterator), media_type="text/event-stream")
        if reply.status_code != 200:
            return reply
        return JSONResponse(from_chat(shape, json.loads(reply.body)))

    add_tokenizer_routes(app, llm, limits)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "forerun"}
                                           for n in limits.model_names]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": len(scheduler.running), "waiting": scheduler.queue_depth,
                "kv_blocks_used": scheduler.blocks.used, "kv_blocks_total": scheduler.blocks.num_blocks,
                "batch_k_tokens_per_s": scheduler.batch_k.table() if scheduler.batch_k else None,
                "batch_k_steps": scheduler.batch_k.steps() if scheduler.batch_k else None}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Drop every cached prefix block (vLLM's endpoint); 200 with how many were dropped."""
        dropped = await asyncio.wrap_future(scheduler.run_on_engine(scheduler.reset_prefix_cache))
        return {"reset_blocks": dropped, "prefix_cache": scheduler.prefix is not None}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(scheduler), media_type="text/plain; version=0.0.4")

    return app


async def _generate(request: Request, body, prompt, max_tokens: int | None, chat: bool, grammar=None,
                    tools: bool = False):
    """grammar: the tool calls' (chat_turn), else the request's structured output is compiled here."""
    st = request.app.state
    loop = asyncio.get_running_loop()
    if (unused := body.unused_fields()) and not set(unused) <= _SAID:
        _SAID.update(unused)  # (once per field name: a client that always sends them fills no log)
        log.warning("forerun serve: accepted and not used: %s", ", ".join(unused))
    queue: asyncio.Queue[Event] = asyncio.Queue()
    n_logprobs = body.logprob_count() if chat else body.logprobs
    echo = None if chat else await _echo(st, body, prompt)
    if echo is not None and max_tokens == 0:  # score the prompt only (lm-eval's log-likelihood)
        shape = Shape(chat, st.limits.model_names[0], len(echo.ids), echo=echo, logprob_n=n_logprobs)
        return JSONResponse(shape.full("", Event(finish_reason="length"), []))
    if grammar is None and body.structured_fields():
        grammar = await loop.run_in_executor(None, compile_structured, st.llm, body)
    # n choices: n requests decoded side by side (a seeded one's i-th choice draws with seed + i)
    bodies = [body if body.seed is None or not i else body.model_copy(update={"seed": body.seed + i}) for i in range(body.n)]
    queues = [queue] + [asyncio.Queue() for _ in bodies[1:]]
    reqs = [build_request(st.llm, b, prompt, max_tokens, st.limits, _sink(loop, q), logprobs=n_logprobs,
                          tenant=getattr(request.state, "tenant", b""), grammar=grammar) for b, q in zip(bodies, queues)]
    try:
        for req in reqs:
            st.scheduler.submit(req)
    except QueueFull as e:
        for req in reqs:
            req.cancel()
        raise ApiError(429, str(e), kind="rate_limit_error", code="queue_full") from e
    except TooLarge as e:
        raise ApiError(400, str(e), code="context_length_exceeded", param="max_tokens") from e
    first = Shape(chat, st.limits.model_names[0], len(reqs[0].prompt), echo=echo, logprob_n=n_logprobs,
                  notes=tuple(n for n in [k_note(body, st.limits)] if n), tools=tools)
    shapes = [first] + [dataclasses.replace(first, index=i, _text="", _sent=0) for i in range(1, len(reqs))]
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_stream(st.scheduler, reqs, queues, shapes, usage), media_type="text/event-stream")
    if len(reqs) == 1:
        return await _collect(request, st.scheduler, reqs[0], queue, shapes[0])
    replies = await asyncio.gather(*[_collect(request, st.scheduler, r, q, s) for r, q, s in zip(reqs, queues, shapes)])
    return _merged(replies)


def _merged(replies: list[Response]) -> Response:
    """n whole answers as one: choice i is the i-th request's, usage counts the prompt once."""
    failed = next((r for r in replies if r.status_code != 200), None)
    if failed is not None:
        return failed
    bodies = [json.loads(r.body) for r in replies]
    out = bodies[0]
    out["choices"] = [b["choices"][0] for b in bodies]  # (each carries its index: its Shape's)
    completion = sum(b["usage"]["completion_tokens"] for b in bodies)
    out["usage"].update(completion_tokens=completion, total_tokens=out["usage"]["prompt_tokens"] + completion)
    return JSONResponse(out)


async def _echo(st, body, prompt) -> Echo | None:
    """A completion's echo: the prompt's text and, with logprobs, its tokens' logprobs (scored
    on the engine thread between two steps: the one thread running the model, serve/one_pool.py)."""
    if not body.echo:
        return None
    ids = prompt_ids(st.llm, body, prompt, st.limits)
    if len(ids) > st.limits.max_len:
        raise ApiError(400, f"prompt is {len(ids)} tokens; this server's context is {st.limits.max_len} tokens",
                       code="context_length_exceeded", param="prompt")
    text = prompt if isinstance(prompt, str) else st.llm.tokenizer.decode(ids, skip_special_tokens=False)
    entries = None
    if body.logprobs is not None:
        entries = await asyncio.wrap_future(st.scheduler.run_on_engine(st.llm.score_prompt, ids, body.logprobs))
    return Echo(ids, text, entries, st.llm.token_text)


def _sink(loop, queue: asyncio.Queue):
    def put(ev: Event):
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
            loop.call_soon_threadsafe(queue.put_nowait, ev)
    return put


async def _stream(scheduler: Scheduler, reqs: list[ServeRequest], queues: list[asyncio.Queue], shapes: list[Shape],
                  usage: bool):
    """SSE chunks as text becomes final, every choice's as its request yields them (n > 1: the
    chunks of the choices interleave, each with its index, as OpenAI streams them); a client
    that goes away cancels the requests here (Starlette cancels this generator), which frees
    their rows and blocks before the next step."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, queue: asyncio.Queue) -> None:
        while True:
            ev = await queue.get()
            await merged.put((i, ev))
            if ev.finish_reason or ev.error:
                return

    pumps = [asyncio.create_task(pump(i, q)) for i, q in enumerate(queues)]
    first, lasts, done = [True] * len(reqs), [None] * len(reqs), False
    try:
        while None in lasts:
            i, ev = await merged.get()
            if ev.error:
                yield sse({"error": {"message": ev.error, "type": "server_error", "param": None, "code": None}})
                break
            shape, entries = shapes[i], ev.logprobs  # the tokens generated since the last event: with its text
            text = shape.streamable(ev.text)
            if text or (first[i] and (shape.chat or shape.echo is not None)):
                yield shape.chunk(text, first=first[i], logprobs=entries)
                first[i], entries = False, None
            if ev.finish_reason:
                lasts[i] = ev
                calls, finish = shape.tool_chunks(ev.finish_reason)
                for c in calls:
                    yield c
                yield shape.chunk("", finish, logprobs=entries)
        else:
            if usage:
                yield shapes[0].usage_chunk(lasts[0], sum(e.completion_tokens for e in lasts))
        yield DONE
        done = True
    finally:
        for t in pumps:
            t.cancel()
        if not done:
            for req in reqs:
                req.cancel()
            scheduler.wake()


async def _collect(request: Request, scheduler: Scheduler, req: ServeRequest, queue: asyncio.Queue, shape: Shape):
    """The whole completion; polls for a client disconnect every 0.25 s while waiting, tokens
    arriving or not (then cancels)."""
    parts, entries, done = [], [], False
    loop = asyncio.get_running_loop()
    next_poll = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            try:
                ev = await asyncio.wait_for(queue.get(), timeout=max(0.0, next_poll - loop.time()))
            except asyncio.TimeoutError:
                ev = None
            if ev is not None:
                if ev.error:
                    done = True
                    return JSONResponse({"error": {"message": ev.error, "type": "server_error", "param": None, "code": None}}, 500)
                parts.append(ev.text)
                entries.extend(ev.logprobs or [])
                if ev.finish_reason:
                    done = True
                    return JSONResponse(shape.full("".join(parts), ev, entries))
            if loop.time() >= next_poll:  # (a token every few ms must not starve this check)
                if await request.is_disconnected():
                    return Response(status_code=499)
                next_poll = loop.time() + DISCONNECT_POLL_S
    finally:
        if not done:
            req.cancel()
            scheduler.wake()


def _add_key_check(app: FastAPI, keys: ApiKeys, metrics: ServeMetrics) -> None:
    """With API keys set, the guarded routes answer 401 to a missing or unknown key; the
    caller's tenant (auth.py) goes to request.state for the prefix cache and suffix store."""
    if not keys.enabled:
        return

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if guarded(request.url.path):
            tenant = keys.tenant(request.headers.get("authorization"))
            if tenant is None:
                metrics.rejected.labels("401").inc()
                body = ApiError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                                code="invalid_api_key").body()
                return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            request.state.tenant = tenant
        return await call_next(request)


def _add_error_handlers(app: FastAPI, metrics: ServeMetrics) -> None:
    def error(status: int, message: str, kind: str = "invalid_request_error", code=None, param=None):
        metrics.rejected.labels(str(status)).inc()
        log.warning("forerun serve: %d %s", status, message)
        return JSONResponse(ApiError(status, message, kind, code, param).body(), status_code=status)

    @app.exception_handler(ApiError)
    async def api_error(_req, e: ApiError):
        return error(e.status, e.message, e.kind, e.code, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(_req, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # loc is ("body", character offset): say where, as a line and column
            return error(400, _json_problem(e.body, first))
        problems = [f"{'.'.join(str(x) for x in p.get('loc', ())[1:]) or 'body'}: {p.get('msg', 'invalid')}" for p in e.errors()]
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error(400, "; ".join(problems) if problems else "invalid request", param=where)

    @app.exception_handler(HTTPException)
    async def http_error(_req, e: HTTPException):
        return error(e.status_code, str(e.detail), code=str(e.status_code))


def _json_problem(body, problem: dict) -> str:
    """'the body is not valid JSON: Expecting value at line 2, column 8' from FastAPI's json_invalid error."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body or "")
    loc = problem.get("loc", ())
    pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
    what = (problem.get("ctx") or {}).get("error") or problem.get("msg", "JSON decode error")
    if pos is None:
        return f"the body is not valid JSON: {what}"
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"the body is not valid JSON: {what} at line {line}, column {column} (character {pos})"
