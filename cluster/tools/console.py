"""``raymq console``: the operator's web console, served with aiohttp (which Ray installs).

Every page is drawn in the browser from JSON the same server gives under ``/api/...``
(``raymq.tools.console_pages`` gathers it through ``mq.admin``, as the command line does).
Actions (commit or roll back a half message, abort a Kafka-style transaction, cancel a
timer, resend dead letters) call the very ``mq.admin`` / ``mq`` methods the command line
calls; each needs the console's access token in the ``X-RayMQ-Token`` header (printed
when the console starts, asked once by the page), and a ``--read-only`` console refuses
them all.  Errors are JSON ``{"error": one line}`` with a 4xx status for a bad request
(400), an unknown id (404), an action that no longer fits (409), a missing or wrong token
(401 / 403), and 503 when the cluster does not answer.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading

from aiohttp import web

from raymq.storage.errors import (AlreadyDeliveredError, BrokerUnavailableError,
                                  ConcurrentTransactionsError, InvalidTxnStateError,
                                  NotEnoughReplicasError, NotLeaderError, NotScheduledError,
                                  RequestTimeoutError)
from raymq.tools.console_pages import Pages

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "console_static")
TOKEN_HEADER = "X-RayMQ-Token"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8765
#: the pages whose JSON is ``GET /api/<page>`` (no argument)
PAGES = ("overview", "topics", "halves", "transactions", "timers", "groups")


#: how the admin calls say that what an id names is not there
_NOT_FOUND = ("no such", "not scheduled", "no transactional id", "no half", "not found",
              "expired: it aged out")


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def http_status(err: BaseException) -> int:
    """The HTTP status of an error an admin call raised."""
    text = str(err).lower()
    if isinstance(err, (BrokerUnavailableError, RequestTimeoutError, NotEnoughReplicasError,
                        NotLeaderError)):
        return 503
    if isinstance(err, (LookupError, NotScheduledError)) or any(w in text for w in _NOT_FOUND):
        return 404
    if isinstance(err, (AlreadyDeliveredError, InvalidTxnStateError,
                        ConcurrentTransactionsError)):
        return 409
    if isinstance(err, ValueError):
        return 400
    return 500


def _error(status: int, text: str) -> web.Response:
    return web.json_response({"error": text}, status=status)


@web.middleware
async def _json_errors(request, handler):
    """Under ``/api``, aiohttp's own refusals (no such route, wrong method) are JSON too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if not request.path.startswith("/api/") or exc.status < 400:
            raise
        return _error(exc.status, f"{exc.reason}: {request.method} {request.path}")


class Console:
    """The console's web application over one RayMQ handle."""

    def __init__(self, mq, *, token: str | None = None, read_only: bool = False,
                 pages: Pages | None = None):
        self.mq = mq
        self.read_only = read_only
        #: the access token actions need (None when read-only: there are no actions)
        self.token = None if read_only else (token or secrets.token_urlsafe(16))
        self.pages = pages or Pages(mq)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_json_errors])
        r = app.router
        r.add_get("/", self._index)
        r.add_static("/static/", STATIC)
        r.add_get("/api/session", self._session)
        for page in PAGES:
            r.add_get(f"/api/{page}", self._page(getattr(self.pages, page)))
        r.add_get("/api/message", self._message)
        r.add_get("/api/transactions/{tid}", self._describe)
        r.add_get("/api/groups/{group}/dead-letters", self._dead_letters)
        r.add_post("/api/halves/{id}/{action}", self._half)
        r.add_post("/api/transactions/{tid}/abort", self._abort)
        r.add_post("/api/timers/{id}/cancel", self._cancel)
        r.add_post("/api/groups/{group}/dead-letters/resend", self._resend)
        r.add_post("/api/groups/{group}/reset-offsets", self._reset)
        r.add_post("/api/topics/{topic}/delete", self._delete_topic)
        return app

    # ---------------------------------------------------------------- reads
    async def _index(self, _request):
        return web.FileResponse(os.path.join(STATIC, "index.html"))

    async def _session(self, _request):
        return web.json_response({"read_only": self.read_only,
                                  "token_header": TOKEN_HEADER})

    async def _run(self, fn, *args) -> web.Response:
        """``fn(*args)`` in a worker thread (admin calls block), as JSON or a one-line error."""
        try:
            result = await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        except Exception as err:  # noqa: BLE001 -- every failure is the request's answer
            return _error(http_status(err), one_line(err))
        return web.json_response(result, dumps=lambda o: json.dumps(o, default=str))

    def _page(self, fn):
        async def handler(_request):
            return await self._run(fn)
        return handler

    async def _message(self, request):
        q = request.query
        return await self._run(self.pages.message, q.get("id"), q.get("topic"), q.get("key"))

    async def _describe(self, request):
        return await self._run(self.pages.transaction, request.match_info["tid"])

    async def _dead_letters(self, request):
        return await self._run(self.pages.dead_letters, request.match_info["group"])

    # -------------------------------------------------------------- actions
    def _refused(self, request) -> web.Response | None:
        if self.read_only:
            return _error(403, "this console is read-only (started with --read-only): "
                               "actions are refused")
        given = request.headers.get(TOKEN_HEADER)
        if not given:
            return _error(401, f"this action needs the console's access token (header "
                               f"{TOKEN_HEADER}; `raymq console` printed it when it started)")
        if not secrets.compare_digest(given.encode(), self.token.encode()):
            return _error(403, "wrong access token (the one `raymq console` printed when it "
                               "started)")
        return None

    async def _act(self, request, fn) -> web.Response:
        refused = self._refused(request)
        return refused if refused is not None else await self._run(fn)

    async def _half(self, request):
        action = request.match_info["action"]
        if action not in ("commit", "rollback"):
            return _error(404, f"no action {action!r} on a half message: commit or rollback")
        return await self._act(request, lambda: {
            "result": self.mq.admin.half_resolve(request.match_info["id"], action)})

    async def _abort(self, request):
        return await self._act(request, lambda: {
            "result": self.mq.admin.tx_abort(request.match_info["tid"])})

    async def _cancel(self, request):
        return await self._act(request, lambda: {
            "result": self.mq.cancel_scheduled(request.match_info["id"])})

    async def _resend(self, request):
        refused = self._refused(request)
        if refused is not None:
            return refused
        ids = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                return _error(400, "the body must be JSON: {\"ids\": [dead letter ids]} or "
                                   "empty (every dead letter not resent yet)")
            ids = body.get("ids") if isinstance(body, dict) else body
            if ids is not None and (not isinstance(ids, list)
                                    or not all(isinstance(i, str) for i in ids)):
                return _error(400, f"ids must be a list of dead letter ids, got {ids!r}")
        return await self._run(lambda: {"resent": self.mq.admin.dlq_resend(
            request.match_info["group"], ids or None)})


    async def _reset(self, request):
        """Move a group's offsets on a topic: the body ``{"topic": T, "to": "earliest" |
        "latest" | "datetime" | "duration" | "offset", "value": N, "dry_run": bool}``."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("topic"), str):
            return _error(400, 'the body must be JSON: {"topic": T, "to": "earliest"|"latest"|'
                               '"datetime"|"duration"|"offset", "value": N, "dry_run": false}')
        group = request.match_info["group"]
        plan = await self._run_plain(lambda: self.mq.admin.reset_offsets(
            group, body["topic"], to=body.get("to", ""), value=body.get("value"),
            dry_run=bool(body.get("dry_run"))))
        if isinstance(plan, web.Response):
            return plan
        return web.json_response({"group": group, "dry_run": bool(body.get("dry_run")),
                                  "offsets": [{"queue": f"{t}/{q}", "before": b, "after": a}
                                              for (t, q), (b, a) in sorted(plan.items())]})

    async def _delete_topic(self, request):
        return await self._act(request, lambda: self.mq.delete_topic(
            request.match_info["topic"]))

    async def _run_plain(self, fn):
        """``fn``'s value, or the error response ``_run`` would give."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn)
        except Exception as err:  # (an admin call's refusal: its status, one line)
            return _error(http_status(err), one_line(err))


class ConsoleServer:
    """A ``Console`` served on ``host:port`` from a thread of its own (port 0: any free
    one); ``url`` once started."""

    def __init__(self, console: Console, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT):
        self.console, self.host, self.port = console, host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> "ConsoleServer":
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True,
                                        name="raymq-console")
        self._thread.start()
        ready.wait()
        if self._failed is not None:
            raise self._failed
        self.console.pages.start()
        return self

    def _serve(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        runner = web.AppRunner(self.console.app(), access_log=None)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, self.port)
            loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
        except OSError as err:
            self._failed = OSError(f"cannot serve the console on {self.host}:{self.port}: "
                                   f"{err.strerror or err} (--port picks another)")
            ready.set()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def stop(self) -> None:
        self.console.pages.stop()
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
