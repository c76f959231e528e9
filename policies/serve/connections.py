"""Connection limits of sprawl's HTTP servers (the lane, the admin API, the batch feed): a header
deadline, an idle deadline, a cap, and a share of it per client.

aiohttp, which serves the lane, waits for a request's headers as long as a client likes and
accepts every connection the kernel hands it, so a few hundred idle or slow sockets hold the
server's file descriptors forever. :class:`LaneLimits` bounds them; :class:`LaneSite` (an aiohttp
site) applies them to every connection, plain or TLS, and :meth:`ConnectionLimiter.middleware`
tells it when a connection's first request has arrived.

Guarantees, with the flags that set each limit (:data:`FLAGS`):

- a connection that has not delivered the headers of its first request within
  ``header_timeout_s`` (``--header-timeout``) of being opened gets ``408`` with a JSON error and
  is closed; a TLS handshake, before that, must finish within the same time; on a keep-alive
  connection, every later request's headers must arrive within ``header_timeout_s`` of its
  first byte;
- a keep-alive connection with no request in progress for ``idle_timeout_s``
  (``--idle-timeout``) is closed (aiohttp's keep-alive timer, which starts when a response has
  been sent, so it also bounds how long the headers of a later request on the connection take);
- at most ``max_connections`` (``--max-connections``) connections are open at once, and at most
  ``max_connections_per_client`` (``--max-connections-per-client``) from one client address: one
  more is answered ``503`` ``too_many_connections`` with ``Retry-After`` and closed, never served
  (so one client's flood leaves the rest of the cap to the others);
- the server exports ``sprawl_<server>_connections`` (open now) and
  ``sprawl_<server>_connections_refused_total{reason}`` (``header_timeout``, ``max_connections``,
  ``max_connections_per_client``), ``<server>`` being ``lane`` or ``admin``, and logs
  ``<server>_connection_refused`` for every header timeout and for the first connection refused at
  a cap (the rest of a flood is counted, not logged, until a connection is admitted again).

The request body's deadline (``body_timeout_s``, ``--body-timeout``) and size (``max_body_bytes``,
``--max-body-bytes``) are the route's to keep on the lane (:mod:`policies.serve.server` answers
``408`` when the deadline passes, ``413`` for a body over the size); other servers take
:meth:`ConnectionLimiter.body_deadline`, which reads every body within the deadline first.

Not covered: a client spread over many addresses (a proxy's or firewall's job), a client that is
slow to *read* a response (the kernel's send buffer and TCP keep-alive bound it).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable
from typing import Literal

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field

log = structlog.get_logger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Refusal = Literal["header_timeout", "max_connections", "max_connections_per_client"]
LINGER_S = 2.0
"""How long a refused connection stays open to drop what its client sends (so that closing it
does not reset the connection before the client has read the answer)."""


class LaneLimits(BaseModel):
    """How long a lane client may take, and how many may be connected at once."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    header_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds from a connection's opening to the end of its first request's headers (a TLS
    handshake, before that, has as long again)."""
    idle_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds a keep-alive connection may wait for its next request."""
    body_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds a request's body may take to arrive once its headers have."""
    max_connections: int = Field(default=512, ge=1)
    """Connections open at once; one more is answered 503."""
    max_connections_per_client: int = Field(default=256, ge=1)
    """Connections open at once from one client address; one more is answered 503."""
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    """Bytes a request's body may hold; a longer one is answered 413 unread (the lane's: the
    admin API and the batch feed keep aiohttp's 1 MiB)."""


FLAGS = {
    "header_timeout_s": "--header-timeout",
    "idle_timeout_s": "--idle-timeout",
    "body_timeout_s": "--body-timeout",
    "max_connections": "--max-connections",
    "max_connections_per_client": "--max-connections-per-client",
    "max_body_bytes": "--max-body-bytes",
}
"""The command-line flag of each :class:`LaneLimits` field (``orchestrate serve``, ``sidecar``:
:mod:`policies.serve.options`)."""


def _answer(status: int, reason: str, type_: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer with a lane JSON error that closes the connection."""
    body = json.dumps({"error": {"type": type_, "message": message}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    )
    if status == 503:
        head += "Retry-After: 1\r\n"
    return (head + "\r\n").encode() + body


def _send_and_close(transport: asyncio.Transport, answer: bytes) -> None:
    transport.write(answer)
    if transport.can_write_eof():
        transport.write_eof()  # the client reads the answer, then closes; we close on its EOF
    asyncio.get_running_loop().call_later(LINGER_S, transport.abort)


class ConnectionLimiter:
    """Counts a server's connections and keeps each one's header deadline (module docstring);
    ``server`` names it in metrics and logs (``lane``, ``admin``), ``setting`` names the setting
    of a :class:`LaneLimits` field in a refusal (the lane's: its flag)."""

    def __init__(
        self,
        limits: LaneLimits,
        registry: CollectorRegistry,
        server: str = "lane",
        setting: Callable[[str], str] = FLAGS.__getitem__,
    ) -> None:
        self.limits = limits
        self.server = server
        self.setting = setting
        self._open: dict[object, _Guarded] = {}  # by aiohttp's protocol (``request.protocol``)
        self._per_client: dict[str, int] = {}
        self._full = False  # refusing at a cap since the last connection admitted
        gauge = Gauge(
            f"sprawl_{server}_connections",
            f"{server.capitalize()} connections open now",
            registry=registry,
        )
        gauge.set_function(lambda: len(self._open))
        self._refused = Counter(
            f"sprawl_{server}_connections_refused",
            f"{server.capitalize()} connections closed unserved, by reason (header_timeout, "
            "max_connections, max_connections_per_client)",
            ["reason"],
            registry=registry,
        )

    @property
    def open(self) -> int:
        """Connections being served now."""
        return len(self._open)

    def factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for ``loop.create_server``: ``server``'s, behind the limits."""
        return lambda: _Guarded(self, server)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Marks the connection's request as arrived (its header deadline is met) and, once it
        is answered, the connection as waiting for the next one's headers."""
        guarded = self._open.get(request.protocol)
        if guarded is not None:
            guarded.request_arrived()
        try:
            return await handler(request)
        finally:
            if guarded is not None:
                guarded.awaiting_headers = True

    def full(self, client: str) -> Refusal | None:
        """Which cap a new connection from ``client`` would pass, or None."""
        if self.open >= self.limits.max_connections:
            return "max_connections"
        if self._per_client.get(client, 0) >= self.limits.max_connections_per_client:
            return "max_connections_per_client"
        return None

    @web.middleware
    async def body_deadline(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Reads the request's body within ``body_timeout_s`` before the route sees it (aiohttp
        keeps it for the route's own read); ``408`` and no keep-alive when it is late."""
        if request.body_exists:
            try:
                await asyncio.wait_for(request.read(), self.limits.body_timeout_s)
            except TimeoutError:
                message = (
                    f"request body not received within {self.limits.body_timeout_s} s "
                    f"({self.setting('body_timeout_s')})"
                )
                late = web.json_response(
                    {"error": {"type": "request_timeout", "message": message}}, status=408
                )
                late.force_close()
                return late
        return await handler(request)

    def admit(self, guarded: _Guarded, inner: object) -> None:
        self._open[inner] = guarded
        self._per_client[guarded.client] = self._per_client.get(guarded.client, 0) + 1
        self._full = False

    def release(self, inner: object) -> None:
        guarded = self._open.pop(inner, None)
        if guarded is not None:
            left = self._per_client[guarded.client] - 1
            if left:
                self._per_client[guarded.client] = left
            else:
                del self._per_client[guarded.client]

    def refuse(self, reason: Refusal, transport: asyncio.Transport) -> None:
        self._refused.labels(reason).inc()
        if reason != "header_timeout":
            if self._full:  # logged when a cap was reached; a flood is counted, not logged
                return
            self._full = True
        log.warning(
            f"{self.server}_connection_refused",
            reason=reason,
            peer=transport.get_extra_info("peername"),
            open=self.open,
        )


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol behind the cap and the header deadline. Once refused
    (``inner`` None) it only drops what the client still sends, until the client closes."""

    def __init__(self, limiter: ConnectionLimiter, server: web.Server) -> None:
        self.limiter = limiter
        self.server = server
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.awaiting_headers = True
        """No request in progress: the next bytes start a request whose headers are due within
        the header deadline (the first from the connection's opening)."""
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        limits = self.limiter.limits
        full = self.limiter.full(self.client)
        if full is not None:
            self.limiter.refuse(full, transport)
            held = (
                f"{limits.max_connections} connections ({self.limiter.setting(full)})"
                if full == "max_connections"
                else f"{limits.max_connections_per_client} connections from {self.client} "
                f"({self.limiter.setting(full)})"
            )
            message = f"the server already holds {held}; retry later"
            _send_and_close(
                transport, _answer(503, "Service Unavailable", "too_many_connections", message)
            )
            return
        self.inner = self.server()
        self.limiter.admit(self, self.inner)
        self.inner.connection_made(transport)
        self._deadline = asyncio.get_running_loop().call_later(
            limits.header_timeout_s, self._headers_late
        )

    def request_arrived(self) -> None:
        self.awaiting_headers = False
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        assert self.transport is not None
        self.limiter.refuse("header_timeout", self.transport)
        message = (
            f"request headers not received within {self.limiter.limits.header_timeout_s} s "
            f"({self.limiter.setting('header_timeout_s')})"
        )
        self.transport.write(_answer(408, "Request Timeout", "request_timeout", message))
        self._detach(TimeoutError(message))
        self.transport.close()  # once the answer is flushed

    def _detach(self, exc: Exception | None) -> None:
        """aiohttp's protocol is done with this connection (what comes after is dropped)."""
        inner, self.inner = self.inner, None
        if inner is not None:
            self.limiter.release(inner)
            inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.awaiting_headers and self._deadline is None:  # a later request has begun
            self._deadline = asyncio.get_running_loop().call_later(
                self.limiter.limits.header_timeout_s, self._headers_late
            )
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.request_arrived()  # no deadline left to keep
        self._detach(exc)


class LaneSite(web.BaseSite):
    """A TCP site (like ``web.TCPSite``) whose connections pass a :class:`ConnectionLimiter`."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        limiter: ConnectionLimiter,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self.host, self.port, self.limiter = host, port, limiter

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        tls = self._ssl_context
        self._server = await loop.create_server(
            self.limiter.factory(server),
            self.host,
            self.port,
            ssl=tls,
            ssl_handshake_timeout=self.limiter.limits.header_timeout_s if tls else None,
        )
