"""The HTTP server: OpenAI's /v1/models, /v1/chat/completions and /v1/completions over one decoding Worker, with
/health and /metrics beside them.

Every mistake in a request gets a 4xx in OpenAI's error shape (listing every problem the request has), never a
crash; a full queue gets 429 with a Retry-After estimated from the queue. Prompts are tokenised on a thread of their
own, so a long one never holds up the event loop. Answers carry OpenAI's `usage` and a `treeflash` object: method,
tau, rounds, mean_tree_size.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..batching import BatchEngine
from ..engine import GenerationResult
from ..verify import Sampling
from . import DEFAULT_TEMPERATURE
from .metrics import CONTENT_TYPE
from .openai_api import APIError, ChatRequest, CompletionRequest, Reply, _Request, usage
from .text import TextStream
from .worker import BatchWorker, Finished, Job, QueueFull, Worker, engine_decoder

DISCONNECT_POLL_S = 1.0  # how often a non-streamed request checks that its client is still there
MAX_LISTED_PROBLEMS = 20  # a request's validation problems named in its error message; the rest are counted


@dataclass
class Settings:
    model: str  # the name requests use (and /v1/models lists)
    method: str
    api_key: str | None = None  # None: no authentication
    timeout: float = 600.0  # seconds from arrival to the end of the answer
    # what a request that names none gets
    max_tokens: int = 128
    temperature: float = DEFAULT_TEMPERATURE  # OpenAI's (1); 0 makes the text plain greedy decoding's
    top_p: float = 1.0
    top_k: int = 0  # not an OpenAI field: the server's setting for every request
    seed: int = 0  # seeds the server's draws of the seeds of requests that name none


def create_app(target, worker: Worker, settings: Settings, clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """The app for `target` (which only `worker`'s thread may use for decoding). The app starts the worker, and
    on shutdown lets it finish the requests in flight. `clock` measures the requests' deadlines (tests pass a fake
    one)."""
    seeds = random.Random(settings.seed)
    started = int(time.time())
    # one thread: a tokenizer need not be thread-safe; its own: tokenising a long prompt takes a while
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="treeflash-tokenize")

    async def tokenize(encode, *args) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(tokenizing, encode, *args)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        await asyncio.to_thread(worker.close)
        tokenizing.shutdown()

    app = FastAPI(title="treeflash", lifespan=lifespan)
    app.add_middleware(CountStatus, metrics=worker.metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError):
        return await api_error(request, _validation_error(err))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):  # unknown path, wrong method
        return await api_error(request, APIError(err.status_code, str(err.detail)))

    async def authorize(authorization: str | None = Header(None)) -> None:
        if settings.api_key is None:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send the header Authorization: Bearer KEY",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.get("/models")
    async def models():
        return {"object": "list",
                "data": [{"id": settings.model, "object": "model", "created": started, "owned_by": "treeflash"}]}

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check(req)
        messages = [m.as_dict() for m in req.messages]
        if not any(m["content"].strip() for m in messages):
            raise APIError(400, "the messages are empty", param="messages")
        return await answer(req, await tokenize(target.encode_chat, messages), "messages", request)

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        check(req)
        if not req.text.strip():
            raise APIError(400, "the prompt is empty", param="prompt")
        return await answer(req, await tokenize(target.encode_prompt, req.text, False), "prompt", request)

    def check(req: _Request) -> None:
        if req.model != settings.model:
            raise APIError(404, f"the model `{req.model}` does not exist; this server serves `{settings.model}`",
                           param="model", code="model_not_found")
        req.check_supported()

    async def answer(req: _Request, prompt: list[int], param: str, request: Request):
        context = target.context_length
        if not prompt:  # text the tokenizer drops entirely (control characters)
            raise APIError(400, f"the {param} is empty once tokenised", param=param)
        if len(prompt) + 1 > context:  # no truncation: the client decides what to drop
            raise APIError(400, f"the prompt has {len(prompt)} tokens; the model's context holds {context}, "
                           "prompt and at least one new token", param=param, code="context_length_exceeded")
        try:
            sampling = Sampling(_given(req.temperature, settings.temperature), settings.top_k,
                                _given(req.top_p, settings.top_p))
        except ValueError as err:  # a temperature too small to divide by (top_p and top_k are checked before)
            raise APIError(400, str(err), param="temperature") from None
        seed = req.seed if req.seed is not None else seeds.randrange(1 << 63)
        job = Job(prompt, min(_given(req.limit, settings.max_tokens), context - len(prompt)), sampling, seed,
                  TextStream(target.decode, req.stops), clock() + settings.timeout, clock=clock)
        try:
            worker.submit(job)
        except QueueFull:
            wait = worker.retry_after()
            raise APIError(429, f"the server is busy ({worker.depth} requests waiting); retry in {wait} s",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(wait)}) from None
        reply = Reply(chat=isinstance(req, ChatRequest), model=settings.model, include_usage=req.include_usage)
        if req.stream:
            return StreamingResponse(_stream(job, reply, len(prompt), settings.method),
                                     media_type="text/event-stream")
        done = await _finish(job, request)
        return reply.body(done.text, done.finish_reason, usage(len(prompt), done.completion_tokens),
                          _extension(settings.method, done.result))

    app.include_router(v1)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model, "method": settings.method, "queue_depth": worker.depth}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(worker.metrics.render(worker.depth), media_type=CONTENT_TYPE)

    return app


async def _finish(job: Job, request: Request) -> Finished:
    """The end of a non-streamed request. A client that leaves stops it at the next round."""
    watcher = asyncio.create_task(_cancel_on_disconnect(job, request))
    try:
        while (event := await job.events.get())[0] == "text":  # the whole text comes with "done"
            pass
    finally:
        watcher.cancel()
    kind, value = event
    if kind == "error":
        raise value
    return value


async def _cancel_on_disconnect(job: Job, request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    job.cancel()


async def _stream(job: Job, reply: Reply, prompt_tokens: int, method: str):
    """Server-sent events in OpenAI's chunk format, then [DONE]; an error (a timeout) as an error event."""
    try:
        if reply.chat:
            yield _event(reply.chunk(first=True))
        while (event := await job.events.get())[0] == "text":
            yield _event(reply.chunk(event[1]))
        kind, value = event
        if kind == "error":
            yield _event(value.body())
        else:
            yield _event(reply.chunk(finish_reason=value.finish_reason, extension=_extension(method, value.result)))
            if reply.include_usage:
                yield _event(reply.usage_chunk(usage(prompt_tokens, value.completion_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # the client left mid-stream: the decoding stops at its next round (no-op once done)


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _extension(method: str, result: GenerationResult) -> dict:
    rounds = result.rounds
    return {"method": method, "tau": round(result.tau, 4), "rounds": len(rounds),
            "mean_tree_size": round(sum(r.tree_size for r in rounds) / max(len(rounds), 1), 4)}


def _given(value, default):
    return default if value is None else value


def _validation_error(err: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400: every problem of the request, each with where it is; `param` names the
    field of the first."""
    errors = err.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    problems = list(dict.fromkeys(f"{'.'.join(map(str, e['loc'][1:])) or 'body'}: {e['msg']}" for e in errors))
    listed = problems[:MAX_LISTED_PROBLEMS]
    if len(problems) > len(listed):
        listed.append(f"and {len(problems) - len(listed)} more problems")
    loc = first["loc"][1:]  # after "body"
    return APIError(400, "; ".join(listed), param=str(loc[0]) if loc else None)


class CountStatus:
    """ASGI middleware: counts the answers by status code (streamed ones when they start)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.request(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def run(target, drafter, settings: Settings, budget: int | str, max_budget: int, max_queue: int, host: str,
        port: int, max_batch: int = 1) -> None:
    """Serve until SIGTERM or Ctrl-C; uvicorn then stops taking requests and lets the ones in flight finish.
    `max_batch` > 1: up to that many requests decoded together (continuous batching)."""
    if max_batch > 1:
        engine = BatchEngine(target, drafter, max_batch, budget, max_budget)
        worker: Worker = BatchWorker(engine, target.eos_ids, max_queue)
    else:
        worker = Worker(engine_decoder(target, drafter, budget, max_budget), target.eos_ids, max_queue)
    uvicorn.run(create_app(target, worker, settings), host=host, port=port)
