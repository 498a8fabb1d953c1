"""The routes of `probe serve` and their guards: Jupyter's token (`?token=`, a Bearer header, then an HttpOnly
SameSite=Strict cookie), bounded bodies, one-line errors, a CSP of this server's own scripts, other origins refused.
Model work runs on the one worker with a time limit; no endpoint takes a path, a model name or code.

One worker thread does all model work (hooks belong to one model). A job its caller gave up on never starts; one past
its deadline gets `JobTimeout` at the next module call from a global forward pre-hook, inside the library's context
managers, which restore the model as on any error."""

from __future__ import annotations

import asyncio
import hmac
import json
import ipaddress
import queue
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from pydantic import BaseModel, ConfigDict, Field
import torch

from probe.errors import ProbeError
from probe.serve.views import Views

ASSETS = Path(__file__).resolve().parents[2] / "reports" / "assets"
if not ASSETS.is_dir():  # installed: reports/ is the subpackage probe.reports
    ASSETS = Path(__file__).resolve().parents[1] / "reports" / "assets"
FILES = {"serve.js": "text/javascript", "serve.css": "text/css", "plotly-cartesian.min.js": "text/javascript"}
COOKIE = "probe_serve_token"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
       "connect-src 'self'; frame-ancestors 'self' http://localhost:* http://127.0.0.1:*; base-uri 'none'; "
       "form-action 'none'")
MAX_BODY = 256 * 1024  # bytes of a request body
MAX_TEXT = 100_000  # characters of a text
MAX_HEADS = 16
MAX_NEW_TOKENS = 64
TIME_LIMIT = 120.0  # seconds a request may wait and run


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    return secrets.token_hex(24)


class JobTimeout(Exception):
    """A job ran past its deadline."""


class Worker:
    """A queue of jobs and the one thread that runs them."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Future, Callable[[], Any], float] | None] = queue.Queue()
        self._deadline = float("inf")
        self._thread = threading.Thread(target=self._run, name="probe-serve-worker", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], Any], seconds: float) -> Future:
        """Queue `work`; its future ends in `JobTimeout` `seconds` after submission."""
        future: Future = Future()
        self._jobs.put((future, work, time.monotonic() + seconds))
        return future

    def close(self) -> None:
        """Stop the thread after the jobs queued so far."""
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _check(self, _module: torch.nn.Module, _args: Any) -> None:
        if threading.current_thread() is self._thread and time.monotonic() > self._deadline:
            raise JobTimeout("the request took longer than its time limit")

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, work, deadline = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued: never started
            if time.monotonic() > deadline:
                future.set_exception(JobTimeout("the request waited in the queue past its time limit"))
                continue
            self._deadline = deadline
            handle = torch.nn.modules.module.register_module_forward_pre_hook(self._check)
            try:
                result, error = work(), None
            except BaseException as failure:  # handed to the caller, who answers it; the worker lives on
                result, error = None, failure
            handle.remove()  # before the caller hears: then nothing of the job is left
            self._deadline = float("inf")
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)


Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]
Index = Annotated[int, Field(ge=0, le=1_000_000)]
HeadPair = Annotated[list[Index], Field(min_length=2, max_length=2)]


class TextBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    text: Text


class HeadBody(TextBody):
    layer: Index
    head: Index


class QKBody(HeadBody):
    query: Index
    key: Index


class DLABody(TextBody):
    position: Index
    token: Index


class AblateBody(TextBody):
    heads: Annotated[list[HeadPair], Field(min_length=1, max_length=MAX_HEADS)]
    method: Annotated[str, Field(max_length=32)] = "zero"
    factor: Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)] = 0.0
    position: Index = 0


class GenerateBody(TextBody):
    heads: Annotated[list[HeadPair], Field(min_length=1, max_length=MAX_HEADS)]
    factor: Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)] = 2.0
    max_new_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] = 20


def _heads(pairs: list[list[int]]) -> list[tuple[int, int]]:
    return [(pair[0], pair[1]) for pair in pairs]


def _one_line(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": " ".join(detail.split())[:500]}, status_code=status)


def _invalid(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return _one_line(422, f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg")))


def _authorised(request: Request, token: str) -> bool:
    header = request.headers.get("authorization", "")
    given = request.query_params.get("token") or request.cookies.get(COOKIE) or header.removeprefix("Bearer ")
    return hmac.compare_digest(given.encode(), token.encode())


class Guard:
    """The token, origin and body size checked before anything runs, security headers on every answer (pure ASGI:
    BaseHTTPMiddleware would hide a client's disconnection, which cancels its queued work)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    def refusal(self, request: Request) -> JSONResponse | None:
        origin, length = request.headers.get("origin"), request.headers.get("content-length")
        if origin is not None and origin.split("://", 1)[-1] != request.headers.get("host"):
            return _one_line(403, "requests from another origin are refused")
        if not _authorised(request, self.token):
            return _one_line(401, "give the token printed when the server started: ?token=...")
        if request.method == "POST" and not (length or "").isdigit():
            return _one_line(411, "give the body's Content-Length")
        if int(length or 0) > MAX_BODY:
            return _one_line(413, f"the request body is over {MAX_BODY // 1024} KiB")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        cookie = request.query_params.get("token") and _authorised(request, self.token)

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.update({"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                                "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"})
                if cookie:
                    headers.append("Set-Cookie", f"{COOKIE}={self.token}; HttpOnly; Path=/; SameSite=Strict")
            await send(message)

        refused = self.refusal(request)
        await (refused or self.app)(scope, receive, secured)


async def _answer(request: Request, worker: Worker, work: Callable[[], Any], seconds: float) -> Any:
    """Run `work` on the worker; give up when the client goes away (cancelling the job if it has not started)."""
    future = worker.submit(work, seconds)
    waiting = asyncio.wrap_future(future)
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=0.2)
        if done:
            break
        if await request.is_disconnected():
            future.cancel()
            return _one_line(499, "the client went away")
    try:  # strict JSON: a NaN or infinity is null
        return json.loads(json.dumps(waiting.result()), parse_constant=lambda _constant: None)
    except ProbeError as error:
        return _one_line(422, str(error))
    except JobTimeout as error:
        return _one_line(504, str(error))


def create_app(views: Views, token: str, *, worker: Worker | None = None, time_limit: float = TIME_LIMIT) -> FastAPI:
    """The FastAPI app serving `views` to holders of `token` (page at /, API under /api, /openapi.json)."""
    app = FastAPI(title="probe serve", docs_url=None, redoc_url=None,
                  description="Every head of one model on a text: attention, scores, QK attribution, DLA, ablation.")
    queue = worker or Worker()
    app.state.worker, app.state.views = queue, views
    app.add_middleware(Guard, token=token)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Exception, lambda _r, error: _one_line(500, f"{type(error).__name__}: {error}"))

    def run(request: Request, work: Callable[[], Any]) -> Awaitable[Any]:
        return _answer(request, queue, work, time_limit)

    @app.get("/", include_in_schema=False)
    def page(request: Request) -> Response:
        html = (ASSETS / "serve.html").read_text(encoding="utf-8")
        query = f"?token={token}" if request.query_params.get("token") else ""
        return Response(html.replace("{query}", query), media_type="text/html")

    @app.get("/assets/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in FILES:
            return _one_line(404, f"no asset {name!r}")
        return FileResponse(ASSETS / name, media_type=FILES[name])

    @app.get("/api/info", summary="The model, its heads, the head classes, the methods and the preset texts")
    async def info(request: Request) -> Any:
        return await run(request, views.info)

    @app.post("/api/text", summary="A text's tokens, per-token loss, top next tokens and every head's scores")
    async def text(request: Request, body: TextBody) -> Any:
        return await run(request, lambda: views.text(body.text))

    @app.post("/api/head", summary="One head's attention on the text and the keys it reads most")
    async def head(request: Request, body: HeadBody) -> Any:
        return await run(request, lambda: views.head(body.text, (body.layer, body.head)))

    @app.post("/api/qk", summary="QK attribution of one (query, key) score of a head (the qk kind's payload)")
    async def qk(request: Request, body: QKBody) -> Any:
        return await run(request, lambda: views.qk(body.text, (body.layer, body.head), body.query, body.key))

    @app.post("/api/dla", summary="Direct logit attribution toward a token at a position (the dla kind's payload)")
    async def dla(request: Request, body: DLABody) -> Any:
        return await run(request, lambda: views.dla(body.text, body.position, body.token))

    @app.post("/api/ablate", summary="Per-token loss and next tokens with heads ablated or scaled, and without")
    async def ablate(request: Request, body: AblateBody) -> Any:
        return await run(request, lambda: views.ablate(body.text, _heads(body.heads), body.method, body.factor,
                                                       body.position))

    @app.post("/api/generate", summary="Greedy continuations with each head scaled (probe.steering.generations)")
    async def generate(request: Request, body: GenerateBody) -> Any:
        return await run(request, lambda: views.generate(body.text, _heads(body.heads), body.factor,
                                                         body.max_new_tokens))

    return app
