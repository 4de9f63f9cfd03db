"""The FastAPI app and `serve()`: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, /health, and
vLLM's /tokenize, /detokenize and /tokenizer_info, in front of one EngineLoop. A client that disconnects,
streaming or not, aborts its requests; SIGTERM stops new requests (503), gives those in flight
`shutdown_timeout` seconds to finish, aborts the rest, and closes the Engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine import Engine
from request import RequestOutput
from server.engine_loop import EngineLoop, QueueFull, ShuttingDown, Submission
from server.errors import APIError, bad_request
from server.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIBody, Plan, chat_plan,
                             completion_plan, parse_body)
from server.responses import (ChoiceStream, Delta, chat_choice, chat_response, completion_choice,
                              completion_response, new_id)
from server.tokenizer_info import tokenizer_info

# Seconds after the shutdown grace (by then every request is aborted) until uvicorn cancels what still runs.
GRACE_MARGIN = 5.0


class Tokenize(OpenAIBody):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True  # the engine's tokenizer adds none either way


class Detokenize(OpenAIBody):
    tokens: list[int]
    model: str | None = None


def create_app(engine_loop: EngineLoop, model_name: str) -> FastAPI:
    """The app; its lifespan starts the engine loop and, at shutdown, stops it (closing the Engine)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        yield
        await asyncio.to_thread(engine_loop.stop)
        stats = engine_loop.stats
        print(f"loop-engine serve: stopped; {stats.finished} requests finished, {stats.aborted} aborted, "
              f"{stats.failed} failed, {stats.refused} refused (429); {engine_loop.leaked_blocks} KV blocks "
              "held when the engine closed", file=sys.stderr, flush=True)

    app = FastAPI(title="loop-engine", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    add_info_routes(app, engine_loop, model_name)
    add_generation_routes(app, engine_loop, model_name)
    return app


def check_open(engine_loop: EngineLoop) -> None:
    """503 once draining (shutdown, or a failed engine, which is closed): before the engine is touched."""
    if engine_loop.failure is not None:
        raise APIError(503, f"the engine failed ({engine_loop.failure}); the server takes no new "
                       "requests", code="engine_failed")
    if engine_loop.draining:
        raise APIError(503, "the server is shutting down and takes no new requests", code="shutting_down")


def add_info_routes(app: FastAPI, engine_loop: EngineLoop, model_name: str) -> None:
    """/health, /v1/models, and vLLM's /tokenizer_info, /tokenize and /detokenize: nothing that generates."""
    engine = engine_loop.engine
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        check_open(engine_loop)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        check_open(engine_loop)
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "loop-engine",
            "root": str(engine.engine_config.model_dir), "max_model_len": engine.max_model_len,
            "loops": engine.engine_config.loops, "exit_policy": str(engine.exit_policy)}]}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict[str, Any]:
        check_open(engine_loop)
        return tokenizer_info(engine.tokenizer, engine.max_model_len)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_body(Tokenize, await read_json(request))
        check_model(req.model, model_name)
        check_open(engine_loop)
        tokens = engine.tokenizer.encode(req.prompt)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
                "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_body(Detokenize, await read_json(request))
        check_model(req.model, model_name)
        check_open(engine_loop)
        bad = [t for t in req.tokens if not 0 <= t < engine.config.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (vocab_size "
                              f"{engine.config.vocab_size})", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def add_generation_routes(app: FastAPI, engine_loop: EngineLoop, model_name: str) -> None:
    """/v1/completions and /v1/chat/completions, whole or streamed."""
    engine = engine_loop.engine

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(CompletionRequest, await read_json(request))
        check_model(req.model, model_name)
        check_open(engine_loop)
        plan = completion_plan(req, engine)
        shape = Completions(new_id("cmpl"), model_name, engine)
        return await respond(engine_loop, request, plan, shape, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await read_json(request))
        check_model(req.model, model_name)
        check_open(engine_loop)
        plan = chat_plan(req, engine)
        return await respond(engine_loop, request, plan, ChatCompletions(new_id("chatcmpl"), model_name), req)


async def respond(engine_loop: EngineLoop, request: Request, plan: Plan, shape: Completions | ChatCompletions,
                  req: CompletionRequest | ChatCompletionRequest) -> Response:
    """Submits the plan; streams it as server-sent events, or waits for it whole, aborting it if the client
    leaves first."""
    submission = submit(engine_loop, plan)
    stream = ChoiceStream(plan)
    if req.stream:
        def abort_unfinished() -> None:
            if not stream.finished:
                engine_loop.abort(submission)

        usage = req.stream_options is not None and req.stream_options.include_usage
        return EventStream(sse(submission, stream, shape, usage), on_close=abort_unfinished)
    work = asyncio.ensure_future(collect(engine_loop, submission, stream))
    left = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not work.done():  # the client left (or the server cancelled this handler): abort
            work.cancel()
    if not work.done() or work.cancelled():
        return Response(status_code=499)  # nobody reads it
    return JSONResponse(shape.whole(work.result(), stream))


class Completions:
    """/v1/completions' objects: text_completion, whole or as chunks."""

    def __init__(self, request_id: str, model: str, engine: Engine) -> None:
        self.request_id, self.model, self.tokenizer = request_id, model, engine.tokenizer
        self.created = int(time.time())

    def chunk(self, delta: Delta, stream: ChoiceStream) -> dict[str, Any]:
        return completion_response(self.request_id, self.model,
                                   [completion_choice(delta, stream, self.tokenizer)], None, self.created,
                                   stream.plan.loops)

    def usage_chunk(self, stream: ChoiceStream) -> dict[str, Any]:
        return completion_response(self.request_id, self.model, [], stream.usage(), self.created,
                                   stream.plan.loops)

    def whole(self, deltas: list[Delta], stream: ChoiceStream) -> dict[str, Any]:
        choices = [completion_choice(d, stream, self.tokenizer) for d in deltas]
        return completion_response(self.request_id, self.model, choices, stream.usage(), self.created,
                                   stream.plan.loops)


class ChatCompletions:
    """/v1/chat/completions' objects: chat.completion, or chat.completion.chunk."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model = request_id, model
        self.created = int(time.time())

    def chunk(self, delta: Delta, stream: ChoiceStream) -> dict[str, Any]:
        return chat_response(self.request_id, self.model, [chat_choice(delta, stream, whole=False)], None,
                             chunk=True, created=self.created, loops=stream.plan.loops)

    def usage_chunk(self, stream: ChoiceStream) -> dict[str, Any]:
        return chat_response(self.request_id, self.model, [], stream.usage(), chunk=True,
                             created=self.created, loops=stream.plan.loops)

    def whole(self, deltas: list[Delta], stream: ChoiceStream) -> dict[str, Any]:
        choices = [chat_choice(d, stream, whole=True) for d in deltas]
        return chat_response(self.request_id, self.model, choices, stream.usage(), chunk=False,
                             created=self.created, loops=stream.plan.loops)


async def read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"the request body is not valid JSON: {err}", None) from None


def check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise APIError(404, f"The model `{name}` does not exist; this server serves `{served}`", "model",
                       "model_not_found")


def submit(engine_loop: EngineLoop, plan: Plan) -> Submission:
    try:
        return engine_loop.submit([p.token_ids for p in plan.prompts], plan.params)
    except QueueFull as err:
        raise APIError(429, str(err), code="queue_full") from None
    except ShuttingDown as err:
        raise APIError(503, str(err), code="shutting_down") from None


def check(item: RequestOutput | BaseException) -> RequestOutput:
    """An output, or its failure as an APIError: refused at add_request, or failed by the engine."""
    if isinstance(item, ShuttingDown):
        raise APIError(503, str(item), code="shutting_down")
    if isinstance(item, ValueError):
        raise bad_request(str(item), "prompt")
    if isinstance(item, BaseException):
        raise APIError(500, str(item))
    failed = [c.error for c in item.outputs if c.finish_reason == "error"]
    if failed:
        raise APIError(500, f"the engine failed this request: {failed[0]}")
    return item


async def collect(engine_loop: EngineLoop, submission: Submission, stream: ChoiceStream) -> list[Delta]:
    """Every choice whole, once all have finished (each output holds everything so far, so only the last of
    each prompt is read). The submission is aborted if this ends early: an error, or a cancel."""
    last: dict[int, RequestOutput] = {}
    try:
        while len(last) < len(submission.request_ids):
            for index, item in await submission.mailbox.take():
                output = check(item)
                if output.finished:
                    last[index] = output
        return [delta for index, output in sorted(last.items()) for delta in stream.update(index, output)]
    finally:
        if len(last) < len(submission.request_ids):
            engine_loop.abort(submission)


async def sse(submission: Submission, stream: ChoiceStream, shape: Completions | ChatCompletions,
              include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per choice that advanced, then the usage chunk if asked, then [DONE].
    An error after the stream began is sent as an error event."""
    try:
        while not stream.finished:
            for index, item in await submission.mailbox.take():
                for delta in stream.update(index, check(item)):
                    yield event(shape.chunk(delta, stream))
        if include_usage:
            yield event(shape.usage_chunk(stream))
    except APIError as err:
        yield event(err.body())
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response that calls on_close() however it ends: sent whole, the client gone (before
    the first chunk too), or cancelled at shutdown; there the server aborts what has not finished."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Any]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, allow_nan=False)}\n\n"


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the engine's shutdown: on SIGTERM or SIGINT the engine loop takes no new requests
    (503), those in flight get `grace` seconds to finish, then the loop aborts them, so each still gets its
    last chunk (finish_reason "abort") before its connection closes. uvicorn's own cancel of whatever is
    still running comes GRACE_MARGIN seconds later, as a backstop."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, grace: float) -> None:
        super().__init__(config)
        self.engine_loop, self.grace = engine_loop, grace

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine_loop.drain()  # a plain store: safe in a signal handler
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine_loop.drain()
        abort = asyncio.get_running_loop().call_later(self.grace, self.engine_loop.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()


def build_server(engine: Engine, model_name: str, max_pending_requests: int = 1024,
                 shutdown_timeout: float = 10.0, log_level: str = "warning") -> DrainingServer:
    """A server for `engine` (not started): run it with server.run(sockets=[bound_socket(...)])."""
    engine_loop = EngineLoop(engine, max_pending_requests)
    config = uvicorn.Config(create_app(engine_loop, model_name), log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + GRACE_MARGIN)
    return DrainingServer(config, engine_loop, shutdown_timeout)


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: an ephemeral one, read back with getsockname())."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_pending_requests: int = 1024, shutdown_timeout: float = 10.0, log_level: str = "info") -> int:
    """Serve until SIGTERM or Ctrl-C (after which uvicorn re-raises the signal, so the process ends by it);
    prints the address it listens on first, and what became of the requests last."""
    server = build_server(engine, model_name, max_pending_requests, shutdown_timeout, log_level)
    try:
        sock = bound_socket(host, port)
    except OSError as err:
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    address = sock.getsockname()
    print(f"loop-engine serve: {model_name} on http://{host}:{address[1]}/v1 (max {max_pending_requests} "
          "requests at once)", file=sys.stderr, flush=True)
    server.run(sockets=[sock])  # on SIGTERM, uvicorn re-raises the signal once shut down
    return 0
