"""The OpenAI-compatible HTTP API (FastAPI): request models, endpoints, errors, streaming.

    POST /v1/chat/completions   the tokenizer's chat template, then generate
    POST /v1/completions        the prompt text (or token ids) as given
    GET  /v1/models             the one model served
    GET  /health                200 while the worker runs
    GET  /metrics               Prometheus text (`metrics.py`)

Every error is OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:
a malformed body or a wrong type is 400, an unknown model 404, a missing or
wrong API key 401, a body over `max_request_bytes` 413, a full queue 429.
Requests are checked in full before they are queued: a failure after that is
the server's, a 500 `server_error` with its cause logged (the server goes
on). The work happens on the scheduler's
worker thread; this module only turns requests into `Job`s and events into
responses (SSE chunks when `stream` is true, ending with `data: [DONE]`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Annotated, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException

import uvicorn

from .generation import Delta, Engine, Failed, Job, Result, Tokenizer
from .metrics import Metrics
from .scheduler import QueueFull, Scheduler, ShuttingDown

log = logging.getLogger("selfspec.serving")
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's legacy endpoint
MAX_STOP_STRINGS = 4
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a request body beyond it gets 413: far more text than a context holds
DRAIN_BYTES = 64 * 1024 * 1024  # a refused body up to this size is read and dropped before the 413 (see BodyLimit)
DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting non-streaming request checks that its client is still there


# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_message(error: dict) -> tuple[str, str | None]:
    """(message, param) for one pydantic error of a request body."""
    # A union's errors name the member tried ('str', 'list[int]', 'function-after[...]'): not part of the path.
    location = [str(part) for part in error.get("loc", ())
                if part != "body" and not (isinstance(part, str) and (part in TYPE_TAGS or "[" in part))]
    param = ".".join(location) or None
    if error.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({error.get('msg', '')})", None
    if error.get("type") == "model_attributes_type" and not location:
        return "the request body must be a JSON object (Content-Type: application/json)", None
    if error.get("type") == "missing":
        return f"missing required parameter: '{param}'", param
    if error.get("type") == "extra_forbidden":
        return f"unknown parameter: '{param}'", param
    where = f"'{param}'" if param else "the request body"
    return f"invalid value for {where}: {error.get('msg', 'invalid')} (got {error.get('input')!r})", param


# --------------------------------------------------------------------------- request bodies

Strict = Field(strict=True)
PositiveInt = Annotated[int, Field(strict=True, ge=1)]
Seed = Annotated[int, Field(strict=True, ge=-(2**63), le=2**64 - 1)]
Temperature = Annotated[float, Field(strict=True, ge=0, le=2)]
TopP = Annotated[float, Field(strict=True, ge=0, le=1)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class Sampling(BaseModel):
    """What both endpoints take. Other OpenAI fields are accepted and ignored unless listed in `UNSUPPORTED`."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None  # default 1.0, as OpenAI; 0: greedy
    top_p: TopP | None = None  # default 1.0; 0: greedy
    seed: Seed | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: Annotated[int, Strict] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the chat template

    role: Annotated[str, Field(strict=True, min_length=1)]
    content: StrictStr | list[TextPart] | None = None

    def for_template(self) -> dict:
        message = {**(self.model_extra or {}), "role": self.role}
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        else:
            message["content"] = self.content or ""
        return message


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None  # the newer name of max_tokens


class CompletionRequest(Sampling):
    prompt: StrictStr | list[StrictStr] | list[Annotated[int, Strict]]


# Fields this server cannot honour: refused (400) when set to anything but the value that means "off".
UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
}


# --------------------------------------------------------------------------- the app


class APIKeyCheck:
    """ASGI middleware: every /v1 request needs `Authorization: Bearer KEY` (compared in constant time)."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.key = key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                message = "missing API key (send Authorization: Bearer KEY)" if not header else "invalid API key"
                response = error_response(401, message, code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before the app reads any of it.

    The body is read here (as the app would read it whole anyway), counting as it arrives, so a body without
    Content-Length (chunked) is cut off at the limit too; the app then gets it in one message.
    """

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self.refuse(scope, receive, send, declared=int(declared))
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await self.refuse(scope, receive, send, more=message.get("more_body", False))
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # a disconnect, for whoever listens

        await self.app(scope, replay, send)

    async def refuse(self, scope, receive, send, *, declared: int = 0, more: bool = True) -> None:
        """Answer 413. The rest of the body, if `more` of it is still to come, is read and dropped first (up to
        `DRAIN_BYTES`): a server that answers and closes while a body still arrives resets the connection, and the
        client may never read the 413."""
        if more and declared <= DRAIN_BYTES:
            drained = 0
            while drained <= DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
                drained += len(message.get("body", b""))
        response = error_response(413, f"the request body is larger than this server's limit of {self.limit} "
                                       f"bytes (--max-request-bytes)", code="request_too_large",
                                  headers={"Connection": "close"})
        await response(scope, receive, send)


class EventStream(StreamingResponse):
    """A streaming response that calls `on_close` however it ends (finished, client gone, server stopping)."""

    def __init__(self, content, on_close) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


DEFAULT_SHUTDOWN_GRACE = 5.0  # seconds running requests get to finish after SIGINT or SIGTERM


class GracefulServer(uvicorn.Server):
    """uvicorn's server for an app of `create_app`: on SIGINT or SIGTERM it first drains the app's scheduler
    (`Scheduler.drain`: new requests 503, running ones `grace` seconds, then stopped), so that uvicorn's wait
    for open responses ends soon after; a second signal exits at once, as in uvicorn."""

    def __init__(self, config: uvicorn.Config, *, grace: float = DEFAULT_SHUTDOWN_GRACE) -> None:
        if not grace >= 0:
            raise ValueError(f"shutdown grace {grace!r} (valid: >= 0 seconds)")
        if config.timeout_graceful_shutdown is None:  # a backstop, should a response not end
            config.timeout_graceful_shutdown = int(grace) + 10
        super().__init__(config)
        self.grace = grace

    def handle_exit(self, sig, frame) -> None:
        scheduler = getattr(getattr(self.config.app, "state", None), "scheduler", None)
        if scheduler is not None:  # not here: a signal handler may have interrupted this thread inside the scheduler
            threading.Thread(target=scheduler.drain, args=(self.grace,), name="selfspec-drain", daemon=True).start()
        super().handle_exit(sig, frame)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(spec, tokenizer, *, model_name: str, max_batch: int = 1, max_queue: int = 64,
               api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               engine: Callable[..., Engine] = Engine) -> FastAPI:
    """An OpenAI-compatible app serving `spec` (`selfspec.wrap(model)`) under the name `model_name`.

    The app owns a `Scheduler` (`app.state.scheduler`) whose worker thread
    starts and stops with the app's lifespan, and its own metrics registry
    (`app.state.metrics`). `engine(spec, tokenizer)` builds what runs the jobs
    (default `Engine`; a benchmark passes another with its interface). A
    request body over `max_request_bytes` gets 413.
    """
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes={max_request_bytes} (valid: >= 1)")
    tokens = Tokenizer(tokenizer)
    metrics = Metrics()
    scheduler = Scheduler(engine(spec, tokens), metrics, max_batch=max_batch, max_queue=max_queue)
    config = spec.model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(text_config, "max_position_embeddings", None)
    vocab_size = spec.model.get_input_embeddings().num_embeddings
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="selfspec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    if api_key:  # the outer check: a request without the key is refused before its body is read
        app.add_middleware(APIKeyCheck, key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_response(error.status, error.message, type=error.type, param=error.param, code=error.code)

    bodies = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        errors = error.errors()
        required = [name for name, field in bodies[request.url.path].model_fields.items() if field.is_required()] \
            if request.url.path in bodies else []
        if any(e.get("type") == "missing" and tuple(e.get("loc", ())) == ("body",) for e in errors) and required:
            names = ", ".join(f"'{name}'" for name in required)
            return error_response(400, f"the request body is empty: missing required parameters {names} "
                                       f"(send a JSON object, Content-Type: application/json)", param=required[0])
        missing = [validation_message(e)[1] for e in errors if e.get("type") == "missing"]
        if len(missing) > 1 and len(missing) == len(errors):
            names = ", ".join(f"'{name}'" for name in missing)
            return error_response(400, f"missing required parameters: {names}", param=missing[0])
        message, param = validation_message(errors[0]) if errors else ("invalid request", None)
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return error_response(error.status_code, str(error.detail), code=code, headers=error.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return error_response(500, f"internal error ({type(error).__name__}); the cause is in the server's log",
                              type="server_error")

    # ------------------------------------------------------------------ checks and jobs

    def check_common(body: Sampling) -> None:
        if body.model != model_name:
            raise APIError(404, f"the model '{body.model}' does not exist (this server serves '{model_name}')",
                           param="model", code="model_not_found")
        if body.n is not None and body.n != 1:
            raise APIError(400, f"n={body.n} is not supported (valid: 1; one choice per request)", param="n")
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise APIError(400, f"'{name}' is not supported by this server", param=name)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise APIError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                                f"non-empty strings", param="stop")

    def make_job(body: Sampling, prompt: list[int], max_tokens: int | None, *, param: str, default: int | None,
                 sink) -> Job:
        if not prompt:
            raise APIError(400, "the prompt is empty: it needs at least one token", param=param)
        if context is not None:
            if len(prompt) >= context:
                raise APIError(400, f"the prompt is {len(prompt)} tokens; this model's context is {context} tokens, "
                                    f"which leaves no room for a completion", param=param,
                               code="context_length_exceeded")
            room = context - len(prompt)
            if max_tokens is not None and max_tokens > room:
                raise APIError(400, f"the prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds this "
                                    f"model's context of {context} tokens (valid max_tokens: 1..{room})",
                               param="max_tokens", code="context_length_exceeded")
            if max_tokens is None:
                max_tokens = room if default is None else min(default, room)
        if max_tokens is None:
            max_tokens = default or DEFAULT_COMPLETION_TOKENS
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return Job(prompt=prompt, max_tokens=max_tokens, stop=stops, stream=bool(body.stream), sink=sink,
                   temperature=1.0 if body.temperature is None else body.temperature,
                   top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed)

    def events_queue() -> tuple[asyncio.Queue, callable]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        return queue, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)

    def submit(job: Job) -> None:
        try:
            scheduler.submit(job)
        except QueueFull as error:
            raise APIError(429, str(error), type="rate_limit_error", code="queue_full") from None
        except ShuttingDown as error:
            raise APIError(503, str(error), type="server_error", code="shutting_down") from None

    def failure(error: BaseException) -> APIError:
        """The answer to a job that failed on the worker (which logged the cause). The request was checked in full
        before it was queued, so what fails there is the server's fault, whatever the exception's type."""
        if isinstance(error, ShuttingDown):
            return APIError(503, str(error), type="server_error", code="shutting_down")
        return APIError(500, f"generation failed ({type(error).__name__}); the cause is in the server's log",
                        type="server_error")

    def stats(result: Result) -> dict:
        return {
            "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                      "total_tokens": result.prompt_tokens + result.completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": result.cached_tokens}},
            "selfspec": {"drafted": result.drafted, "accepted": result.accepted,
                         "tokens_per_pass": round(result.tokens_per_pass, 4)},
        }

    async def wait_for_result(job: Job, events: asyncio.Queue, request: Request) -> Result | None:
        """The job's result; None (and the job cancelled) when the client went away first."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return None
                    continue
                if isinstance(event, Result):
                    return event
                if isinstance(event, Failed):
                    raise failure(event.error)
        finally:
            if job.outcome is None:
                scheduler.cancel(job)

    async def respond(body: Sampling, job: Job, events: asyncio.Queue, request: Request, *, chat: bool):
        submit(job)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model_name}

        def chunk(text: str | None, finish_reason: str | None, **extra) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            return {**head, "choices": [choice], **extra}

        if not body.stream:
            result = await wait_for_result(job, events, request)
            if result is None:
                return Response(status_code=499)  # nobody reads it
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                          "finish_reason": result.finish_reason}
            else:
                choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
            return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                    **stats(result)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            if chat:
                yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    yield sse(chunk(event.text, None))
                elif isinstance(event, Result):
                    summary = stats(event)
                    yield sse(chunk(None, event.finish_reason, selfspec=summary["selfspec"]))
                    if include_usage:
                        yield sse({**head, "choices": [], "usage": summary["usage"]})
                    break
                elif isinstance(event, Failed):
                    error = failure(event.error)
                    yield sse({"error": {"message": error.message, "type": error.type, "param": error.param,
                                         "code": error.code}})
                    break
            yield sse("[DONE]")

        return EventStream(stream(), on_close=lambda: scheduler.cancel(job))

    # ------------------------------------------------------------------ endpoints

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_common(body)
        if not body.messages:
            raise APIError(400, "messages is empty: a chat needs at least one message", param="messages")
        if not tokens.has_chat_template:
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions",
                           param="messages")
        try:
            prompt = await asyncio.to_thread(tokens.encode_chat, [m.for_template() for m in body.messages])
        except Exception as error:  # the template's own checks (roles must alternate, ...)
            raise APIError(400, f"the chat template refused these messages: {error}", param="messages") from None
        events, sink = events_queue()
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        job = make_job(body, prompt, max_tokens, param="messages", default=None, sink=sink)
        return await respond(body, job, events, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_common(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request are not supported (valid: one prompt)",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(tokens.encode_text, prompt)  # seconds for a long text: not on the loop
        else:
            ids = list(prompt)
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is out of range for this model's vocabulary "
                                    f"(valid: 0..{vocab_size - 1})", param="prompt")
        events, sink = events_queue()
        job = make_job(body, ids, body.max_tokens, param="prompt", default=DEFAULT_COMPLETION_TOKENS, sink=sink)
        return await respond(body, job, events, request, chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "selfspec"}]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_name:
            raise APIError(404, f"the model '{name}' does not exist (this server serves '{model_name}')",
                           param="model", code="model_not_found")
        return {"id": model_name, "object": "model", "created": started, "owned_by": "selfspec"}

    @app.get("/health")
    async def health():
        if scheduler.worker is None or not scheduler.worker.is_alive():
            return error_response(503, "the worker is not running", type="server_error")
        return {"status": "ok", "model": model_name, "queue_depth": scheduler.queue_depth}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
