"""``manage.py serve [--host H] [--port P] [--no-background]``: daphne + background services.

daphne serves HTTP and websockets with its websocket message and frame caps raised to
16 MiB + 64 KiB and its 24-hour socket timeout off; each consumer enforces its own
protocol's limit (docs/ws-protocol.md#limits, docs/shim-protocol.md#connecting). Unless
``--no-background`` the background services run as asyncio tasks on the same loop.
SIGTERM/SIGINT: stop accepting, fail pending remote calls, close sockets, exit 0 within
10 s. With ``DISPATCH_BEHIND_PROXY`` the client address and scheme come from the proxy's
``X-Forwarded-*`` headers (``proxy_header_options``). A wildcard public URL
(``http://0.0.0.0:…``) is refused, and so is a wildcard ``--host`` while no
``DISPATCH_PUBLIC_URL`` names this machine; once listening, the public URL is recorded in
``DISPATCH_DATA_DIR/public_url.json`` for the other ``manage.py`` commands
(docs/operating.md#settings), and removed at exit.
"""

from __future__ import annotations

import asyncio
import faulthandler
import ipaddress
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from core import services
from core.consumers import shutdown_local_connections
from core.models import ServerProcess
from core.open_files import raise_open_file_limit
from core.presence import current_process_id
from dispatch.background import heartbeat_loop, revocation_loop, run_background_services
from dispatch.mcp.streams import close_all as close_mcp_streams
from machines.services.command_runs import command_runs_shutdown

logger = logging.getLogger("dispatch.serve")

SHUTDOWN_GRACE = 3.0  # seconds given to consumers to fail their calls and close
TASKS_GRACE = 12.0  # seconds given to cancelled background services to wind down

# RFC 6455 §7.4.1 codes a server may send that autobahn's sendClose() refuses (it allows
# only 1000 and 3000-4999): 1009 (message too big) and 1012 (service restart) are
# part of Dispatch's protocols.
PROTOCOL_CLOSE_CODES = frozenset({1001, 1008, 1009, 1011, 1012, 1013})


def allow_protocol_close_codes() -> None:
    """Let consumers close with the RFC 6455 codes above under daphne."""
    from autobahn.websocket.protocol import WebSocketProtocol as AutobahnProtocol
    from daphne.ws_protocol import WebSocketProtocol

    if getattr(WebSocketProtocol.serverClose, "dispatch_patched", False):
        return
    original = WebSocketProtocol.serverClose

    def server_close(self: Any, code: int | None = None) -> None:
        if code in PROTOCOL_CLOSE_CODES:
            if self.state == AutobahnProtocol.STATE_OPEN:
                self.sendCloseFrame(code=code, isReply=False)
            return
        original(self, code)

    server_close.dispatch_patched = True  # type: ignore[attr-defined]
    WebSocketProtocol.serverClose = server_close


# Seconds a connection whose request body was refused keeps reading (and dropping) what the
# client still sends, so the client reads the 413 before the socket closes: closing with
# unread data would reset the connection and could discard the answer.
REFUSED_BODY_LINGER = 2.0


def cap_request_bodies(max_bytes: int) -> None:
    """Refuse HTTP request bodies over ``max_bytes`` inside daphne, before they are buffered.

    daphne reads a whole body (to a temporary file, then into the application's queue)
    before the ASGI application runs, so no middleware can stop a huge one. A
    ``Content-Length`` over the cap is refused as soon as the headers are in; a chunked
    body once its running size passes the cap. The answer is 413 with the API's error
    shape (``{"error": {"code": "REQUEST_TOO_LARGE", …}}``) and ``Connection: close``;
    the rest of the body is read and dropped for ``REFUSED_BODY_LINGER`` seconds at most,
    then the connection closes. The application never sees the request.
    """
    from daphne.http_protocol import WebRequest

    if getattr(WebRequest.gotLength, "dispatch_patched", False):
        return
    original_got_length = WebRequest.gotLength
    original_chunk = WebRequest.handleContentChunk
    original_received = WebRequest.requestReceived

    def got_length(self: Any, length: int | None) -> None:
        self.dispatch_body_bytes = 0
        self.dispatch_refused = False
        if length is not None and length > max_bytes:
            _refuse_body(self, max_bytes)
            return
        original_got_length(self, length)

    def handle_content_chunk(self: Any, data: bytes) -> None:
        if getattr(self, "dispatch_refused", False):
            return
        self.dispatch_body_bytes = getattr(self, "dispatch_body_bytes", 0) + len(data)
        if self.dispatch_body_bytes > max_bytes:
            _refuse_body(self, max_bytes)
            return
        original_chunk(self, data)

    def request_received(self: Any, command: bytes, path: bytes, version: bytes) -> None:
        if getattr(self, "dispatch_refused", False):
            return
        original_received(self, command, path, version)

    got_length.dispatch_patched = True  # type: ignore[attr-defined]
    WebRequest.gotLength = got_length
    WebRequest.handleContentChunk = handle_content_chunk
    WebRequest.requestReceived = request_received


def leave_form_bodies_to_django() -> None:
    """Keep twisted from parsing form bodies: daphne hands the raw body to Django.

    twisted's ``Request`` parses a ``multipart/form-data`` or urlencoded POST body into
    ``request.args`` before daphne sees the request, and answers a body it cannot parse
    (an empty multipart, a bad boundary) itself: ``400 Bad Request`` with no headers and
    no body, outside the API's error shape. daphne never reads ``args``, so every request
    is built with ``parsePOSTFormSubmission=False`` (twisted's own switch for this) and
    such a body reaches Django, which answers it like any other (DRF: 415).
    """
    from daphne.http_protocol import WebRequest

    if getattr(WebRequest.__init__, "dispatch_patched", False):
        return
    original_init = WebRequest.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["parsePOSTFormSubmission"] = False
        original_init(self, *args, **kwargs)

    init.dispatch_patched = True  # type: ignore[attr-defined]
    WebRequest.__init__ = init


class _SocketDrained:
    """A twisted push producer registered on a streamed response: twisted pauses it when
    the connection's send buffer is full and resumes it when that buffer has drained."""

    def __init__(self) -> None:
        self.drained = asyncio.Event()
        self.drained.set()

    def pauseProducing(self) -> None:
        self.drained.clear()

    def resumeProducing(self) -> None:
        self.drained.set()

    def stopProducing(self) -> None:
        self.drained.set()


def pace_streamed_responses() -> None:
    """Back-pressure for streamed HTTP responses: an application's ``send`` of a body chunk
    with ``more_body`` returns only once the client has taken the bytes (the socket's send
    buffer drained below twisted's mark, about 64 KiB past the kernel's own buffer).

    daphne writes every ``http.response.body`` message into the transport and returns at
    once, so a streamed response to a slow reader grew the server's memory without bound: a
    live operation's event stream (docs/live-operations.md#streamed-output) grants the
    machine more output as it sends events, so without this a command printing fast to a
    slow ``curl`` was buffered whole in the server. With it the stream's consumer waits, its
    credit stops, and the command waits on the machine. Uses twisted's producer API on the
    request (``registerProducer`` with a push producer, unregistered before the last chunk
    finishes the request); the wait re-checks the connection every second, so a client that
    went away ends it.
    """
    from daphne.server import Server

    if getattr(Server.handle_reply, "dispatch_patched", False):
        return
    original_handle_reply = Server.handle_reply

    async def handle_reply(self: Any, protocol: Any, message: dict[str, Any]) -> None:
        pacer: _SocketDrained | None = None
        if message.get("type") == "http.response.body" and hasattr(protocol, "registerProducer"):
            pacer = getattr(protocol, "dispatch_pacer", None)
            if message.get("more_body"):
                if pacer is None and not protocol.finished and protocol.channel is not None and not protocol.producer:
                    pacer = protocol.dispatch_pacer = _SocketDrained()
                    protocol.registerProducer(pacer, True)
            elif pacer is not None:
                if protocol.producer is pacer and protocol.channel is not None:
                    protocol.unregisterProducer()
                protocol.dispatch_pacer = pacer = None
        await original_handle_reply(self, protocol, message)
        while pacer is not None and not pacer.drained.is_set():
            if protocol.finished or getattr(protocol, "_disconnected", False) or protocol.channel is None:
                return
            try:
                async with asyncio.timeout(1.0):
                    await pacer.drained.wait()
            except TimeoutError:
                continue

    handle_reply.dispatch_patched = True  # type: ignore[attr-defined]
    Server.handle_reply = handle_reply


def _refuse_body(request: Any, max_bytes: int) -> None:
    """Answer 413 REQUEST_TOO_LARGE on ``request``'s connection, drop the rest, close."""
    import json

    request.dispatch_refused = True
    # No "100 Continue" after the refusal (twisted sends it once the length is known).
    request.requestHeaders.removeHeader(b"Expect")
    channel = request.channel
    transport = channel.transport if channel is not None else None
    if transport is None:
        return
    body = json.dumps(
        {
            "error": {
                "code": "REQUEST_TOO_LARGE",
                "message": f"the request body is over this server's limit of {max_bytes} bytes "
                "(DISPATCH_MAX_REQUEST_BYTES)",
                "details": {"max_bytes": max_bytes},
            }
        }
    ).encode()
    head = (
        b"HTTP/1.1 413 Content Too Large\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n".encode()
        + b"Connection: close\r\n\r\n"
    )

    def drop(data: bytes) -> None:
        return None

    # Stop parsing this connection: what the client still sends is read and dropped.
    channel.persistent = False
    channel.dataReceived = drop
    channel.rawDataReceived = drop
    channel.lineReceived = drop
    transport.write(head + body)
    if hasattr(transport, "loseWriteConnection"):
        transport.loseWriteConnection()
    else:
        transport.loseConnection()
    abort = getattr(transport, "abortConnection", transport.loseConnection)
    asyncio.get_event_loop().call_later(REFUSED_BODY_LINGER, abort)  # twisted runs on asyncio here


def wildcard_public_url_error(public_url: str) -> str | None:
    """Why ``public_url`` cannot be handed out, or ``None``: a wildcard host (``0.0.0.0``,
    ``::``) is where a server listens, not an address anyone can reach it at, and with it
    every request by the machine's real name would be refused as a bad ``Host``."""
    host = urlsplit(public_url).hostname or ""
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return None
    if not wildcard:
        return None
    try:
        port = urlsplit(public_url).port
    except ValueError:  # a port out of range: the example goes without one
        port = None
    example = f"http://laptop.lan:{port}" if port else "http://laptop.lan"
    return (
        f"the public URL is {public_url}, a wildcard address: agents, shims, peers and browsers cannot reach "
        f"this server there. Set DISPATCH_PUBLIC_URL to the address they use, e.g. "
        f"DISPATCH_PUBLIC_URL={example} (environment or .env; docs/deployment.md#public-url)"
    )


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def unnamed_wildcard_host_error(host: str, port: int, public_url_source: str) -> str | None:
    """Why ``serve --host <wildcard>`` cannot start, or ``None``: listening on every
    interface is for other computers, and unless ``DISPATCH_PUBLIC_URL`` names this
    machine (``public_url_source`` ``"DISPATCH_PUBLIC_URL"``) they would be handed the
    default ``http://127.0.0.1:8000``, or the URL another running ``serve`` on this data
    dir recorded, and their requests naming this machine refused as a bad ``Host``."""
    if public_url_source == "DISPATCH_PUBLIC_URL" or not _is_wildcard(host):
        return None
    return (
        f"--host {host} listens on every interface, but DISPATCH_PUBLIC_URL is not set: agents, shims, peers and "
        f"browsers on other computers need the address they reach this one at. Set it, e.g. "
        f"DISPATCH_PUBLIC_URL=http://laptop.lan:{port} (environment or .env; docs/deployment.md#public-url)"
    )


def records_its_public_url(public_url_source: str, record: Path) -> bool:
    """Whether this ``serve`` writes ``record``: not when its public URL was read from that
    very record (``public_url_source`` is the record's path, so another live ``serve`` on
    this data dir wrote it): that process keeps its record, and stopping this one leaves
    it in place for the commands that read it."""
    return public_url_source != str(record)


def record_public_url(record: Path, url: str) -> None:
    """Write ``{"url": url, "pid": <this process>}`` to ``record`` (atomically), so
    commands run beside this server use its public URL (``dispatch.settings``)."""
    partial = record.with_name(f".{record.name}.{os.getpid()}")
    partial.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(partial, record)


def forget_public_url(record: Path) -> None:
    """Remove ``record`` if this process wrote it (another ``serve`` may have since)."""
    try:
        if json.loads(record.read_text()).get("pid") == os.getpid():
            record.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def proxy_header_options(behind_proxy: bool) -> dict[str, str | None]:
    """daphne's proxy-header options for ``DISPATCH_BEHIND_PROXY`` (docs/operating.md#behind-a-proxy).

    On: the ASGI scope's ``client`` of every HTTP request and websocket upgrade is the
    first ``X-Forwarded-For`` entry (port 0), and an HTTP request's ``scheme`` is
    ``X-Forwarded-Proto`` — daphne reads the scheme only when ``X-Forwarded-For`` is
    present, and never puts one in a websocket scope (the origin check takes it from the
    header through ``SECURE_PROXY_SSL_HEADER`` instead). A request without the header keeps
    its TCP peer. The proxy must overwrite ``X-Forwarded-For`` with the address it sees
    (nginx: ``$remote_addr``), or a client could name any address. ``X-Forwarded-Port``
    is not read: daphne would take it for the client's port, while proxies send the port
    the client connected to. Off: all ``None``, the headers are ignored.
    """
    if not behind_proxy:
        return {
            "proxy_forwarded_address_header": None,
            "proxy_forwarded_port_header": None,
            "proxy_forwarded_proto_header": None,
        }
    return {
        "proxy_forwarded_address_header": "X-Forwarded-For",
        "proxy_forwarded_port_header": None,
        "proxy_forwarded_proto_header": "X-Forwarded-Proto",
    }


class Command(BaseCommand):
    help = "Serve Dispatch (HTTP + websockets) with daphne, plus the background services."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
        parser.add_argument(
            "--no-background", action="store_true", help="serve connections only; run dispatch_worker separately"
        )

    def handle(self, *args: Any, host: str, port: int, no_background: bool, **options: Any) -> None:
        if not 0 < port < 65536:
            raise CommandError(f"--port must be between 1 and 65535, got {port}")
        refused = wildcard_public_url_error(settings.PUBLIC_URL) or unnamed_wildcard_host_error(
            host, port, settings.PUBLIC_URL_SOURCE
        )
        if refused:
            raise CommandError(refused)
        # `kill -USR1 <pid>` prints every thread's stack to stderr: for a process that hangs.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        # Importing daphne.server installs twisted's asyncio reactor: keep it inside handle.
        from channels.routing import get_default_application
        from daphne.endpoints import build_endpoint_description_strings
        from daphne.server import Server
        from twisted.internet import reactor

        before, after = raise_open_file_limit()
        if after < 4096:
            logger.warning(
                "open-file limit %s: this process can hold fewer than ~%s connections; raise the hard limit "
                "(ulimit -Hn, systemd LimitNOFILE=) to hold more",
                after,
                after - 100,
            )
        elif after != before:
            logger.info("open-file limit raised from %s to %s", before, after)
        allow_protocol_close_codes()
        cap_request_bodies(settings.MAX_REQUEST_BYTES)
        leave_form_bodies_to_django()
        pace_streamed_responses()
        services.server_process_register(kind=ServerProcess.Kind.SERVE)
        connection.close()  # the main thread does no more queries

        runtime = _Runtime(background=not no_background)

        class DispatchServer(Server):
            def listen_success(self, port: Any) -> None:
                super().listen_success(port)
                runtime.ports.append(port)
                address = port.getHost()
                try:
                    if records_its_public_url(settings.PUBLIC_URL_SOURCE, settings.PUBLIC_URL_RECORD):
                        record_public_url(settings.PUBLIC_URL_RECORD, settings.PUBLIC_URL)
                except OSError as exc:
                    logger.warning("could not record the public URL in %s: %s", settings.PUBLIC_URL_RECORD, exc)
                print(
                    f"Dispatch serving on http://{host}:{address.port} "
                    f"(process {current_process_id()}, background services "
                    f"{'off' if no_background else 'on'}"
                    f"{', client address from X-Forwarded-For' if settings.BEHIND_PROXY else ''})",
                    flush=True,
                )
                public = urlsplit(settings.PUBLIC_URL)
                public_port = public.port or (443 if public.scheme == "https" else 80)
                # Behind a proxy the public URL is the proxy's, on another port by design.
                loopback = public.hostname in ("127.0.0.1", "localhost", "::1")
                if loopback and public_port != address.port and not settings.BEHIND_PROXY:
                    print(
                        f"Warning: DISPATCH_PUBLIC_URL is {settings.PUBLIC_URL}, but this process serves port "
                        f"{address.port}: agents, shims and peers are told the public URL. Set "
                        "DISPATCH_PUBLIC_URL to the address they should use.",
                        flush=True,
                    )

        server = DispatchServer(
            application=get_default_application(),
            endpoints=build_endpoint_description_strings(host=host, port=port),
            signal_handlers=False,
            websocket_timeout=-1,
            websocket_max_message_size=settings.SERVER_WS_MAX_BYTES,
            websocket_max_frame_size=settings.SERVER_WS_MAX_BYTES,
            ping_interval=20,
            ping_timeout=30,
            application_close_timeout=5,
            **proxy_header_options(settings.BEHIND_PROXY),
        )
        runtime.server = server
        reactor.callWhenRunning(runtime.start)
        try:
            server.run()
        finally:
            forget_public_url(settings.PUBLIC_URL_RECORD)
        if runtime.failed:
            raise CommandError(f"could not listen on {host}:{port}")
        exit_now(0)


def exit_now(code: int) -> None:
    """End the process once the event loop has stopped, without joining worker threads.

    A thread still running blocking work (a CLI supervisor pass, a tmux call) may be
    waiting for the stopped loop to run an after-commit broadcast; Python would join it
    at exit for ever. Its rows are committed (the broadcast is only a doorbell), so the
    process flushes its output, closes its database connections and leaves.
    """
    import os
    import sys

    from django.db import connections

    try:
        connections.close_all()
    except Exception:
        logger.exception("closing database connections at exit failed")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Runtime:
    """What ``serve`` runs beside daphne: heartbeat, background services, clean shutdown."""

    def __init__(self, *, background: bool) -> None:
        self.background = background
        self.ports: list[Any] = []
        self.tasks: list[asyncio.Future[Any]] = []
        self.stopping = False
        self.server: Any = None

    @property
    def failed(self) -> bool:
        return not self.ports

    def start(self) -> None:
        loop = asyncio.get_event_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, lambda: asyncio.ensure_future(self.shutdown()))
        self.tasks.append(asyncio.ensure_future(heartbeat_loop(kind=ServerProcess.Kind.SERVE)))
        # Like the heartbeat, on every process that holds connections (even --no-background).
        self.tasks.append(asyncio.ensure_future(revocation_loop()))
        if self.background:
            self.tasks.append(asyncio.ensure_future(run_background_services()))

    async def shutdown(self) -> None:
        from asgiref.sync import sync_to_async
        from twisted.internet import reactor

        if self.stopping:
            logger.warning("second signal: stopping at once")
            reactor.stop()  # type: ignore[misc]
            return
        self.stopping = True
        logger.info("shutting down: no new connections; failing pending calls")
        for port in self.ports:
            port.stopListening()
        close_mcp_streams()  # MCP event streams end now: their clients reconnect to another process
        # Before the row goes (its CANCELs would end them "cancelled"): each run writes lost, with its output.
        await command_runs_shutdown()
        for task in self.tasks:
            task.cancel()
        # Whether every socket closed in time: then each consumer failed what it had forwarded,
        # and the row stays as a stopped marker (callers may re-route unanswered calls).
        answered_all = False
        try:
            await shutdown_local_connections()
            # Background work in threads (a CLI supervisor pass) needs the loop to finish.
            await asyncio.wait(self.tasks, timeout=TASKS_GRACE)
            answered_all = await self._wait_for_sockets()
        except Exception:
            logger.exception("error while closing connections")
        try:
            await sync_to_async(services.server_process_unregister, thread_sensitive=True)(leave_marker=answered_all)
        except Exception:
            logger.exception("could not remove this process's row; the reaper will")
        reactor.stop()  # type: ignore[misc]

    async def _wait_for_sockets(self) -> bool:
        """Wait up to SHUTDOWN_GRACE for every websocket to close; whether they all did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHUTDOWN_GRACE
        while loop.time() < deadline:
            live = [p for p, details in self.server.connections.items() if "disconnected" not in details]
            if not any(type(p).__name__ == "WebSocketProtocol" for p in live):
                return True
            await asyncio.sleep(0.1)
        return False
