"""Serve Python functions as a Dispatch remote (docs/ws-protocol.md#the-python-client)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import random
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import pydantic
from pydantic_core import to_jsonable_python
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from .schema import function_spec
from .session import (
    DEFAULT_URL,
    AuthenticationError,
    MessageTooLarge,
    RemoteCallError,
    Session,
    encode_message,
    websocket_url,
)

logger = logging.getLogger("remotes.client")

F = TypeVar("F", bound=Callable[..., Any])

URL_ENV = "DISPATCH_URL"
"""Environment variable naming the instance: its base URL ``http(s)://host:port`` (as
Dispatch sets it for its agents) or its ``ws(s)://host:port/ws``."""
TOKEN_ENV = "DISPATCH_TOKEN"
"""Environment variable holding the API token."""

Announce = Callable[[str], None]
"""Told one line each time the remote is registered: ``serving 'name' (n functions) on URL``."""

RECONNECT_DELAY = 0.5
"""Seconds before the first reconnect; doubles on each failed attempt."""
RECONNECT_DELAY_MAX = 30.0
"""Cap of the reconnect delay, in seconds (before jitter)."""
REGISTER_RETRY_WINDOW = 30.0
"""Seconds to keep retrying ``remote-connect`` while the server still holds the old
registration of this remote (it has not noticed the old session close yet)."""
ERROR_MAX_CHARS = 10_000
"""Longer error strings are cut so that an error result always fits in one frame."""


class RemoteDisconnected(Exception):
    """Another session of the user disconnected this remote (``remote-disconnected``).

    The message names the remote and the server's reason. :meth:`Remote.serve` raises it
    and does not register the name again: whoever disconnected it meant it to stop.
    """


@dataclass(frozen=True)
class _Function:
    spec: dict[str, Any]
    call: Callable[..., Any]  # validates the keyword arguments, then calls the function
    is_async: bool


class Remote:
    """A named set of functions served over a ``/ws`` session (docs/ws-protocol.md#the-python-client).

    ``url`` names the instance, by its base URL ``http(s)://host:port`` or its
    ``ws(s)://host:port/ws``; ``None`` means ``$DISPATCH_URL``, else
    :data:`.session.DEFAULT_URL`. ``token`` is an API token; ``None`` means
    ``$DISPATCH_TOKEN``. Both are plain attributes, read each time :meth:`serve` connects (so
    ``dispatch-remote serve FILE.py:VARIABLE --server URL --token T`` may set them after the
    file is imported). ``functions`` are registered as if decorated with :meth:`function`.
    """

    def __init__(
        self,
        name: str,
        *,
        url: str | None = None,
        token: str | None = None,
        functions: Iterable[Callable[..., Any]] | None = None,
    ) -> None:
        self.name = name
        self.url = url
        self.token = token
        self._functions: dict[str, _Function] = {}
        self._calls: set[asyncio.Task[None]] = set()
        self._disconnected: str | None = None  # the reason, once another session disconnected us
        self._closing: set[asyncio.Task[None]] = set()
        for function in functions or ():
            self.function(function)

    def function(self, function: F) -> F:
        """Register ``function`` (sync or ``async def``) and return it unchanged.

        Its spec comes from :func:`.schema.function_spec`; calls validate
        their ``args`` against the type hints with pydantic (so a parameter annotated
        with a pydantic model receives the model). Raises ``ValueError`` for a second
        function of the same name and ``TypeError`` for a parameter that cannot be
        passed by keyword.
        """
        spec = function_spec(function)
        if spec["name"] in self._functions:
            raise ValueError(f"remote {self.name!r} already has a function named {spec['name']!r}")
        self._functions[spec["name"]] = _Function(
            spec=spec,
            call=pydantic.validate_call(function),
            is_async=inspect.iscoroutinefunction(function),
        )
        return function

    @property
    def specs(self) -> list[dict[str, Any]]:
        """The ``tools`` sent with ``remote-connect``: ``[{name, description, parameters}]``."""
        return [function.spec for function in self._functions.values()]

    def run(self, *, retry_window: float | None = None) -> None:
        """Serve until interrupted (Ctrl-C returns) or refused; see :meth:`serve`.

        Prints one line on stderr when the remote is registered (``serving 'name' (2
        functions) on ws://…/ws``) and one on each re-registration after a reconnect, so
        that a plain script says that it serves; the failed attempts in between are
        logged as warnings. ``retry_window`` (seconds; ``None`` means
        :data:`REGISTER_RETRY_WINDOW`, 30) is how long the first registration waits for a
        name another session still holds.

        Ends the program as ``dispatch-remote serve`` does (the refusals of
        docs/ws-protocol.md#remote-connect):
        without a token or with a malformed URL, when the name is still held by another
        session after ``retry_window``, when the token is refused or when another session
        disconnects the remote, it exits (``SystemExit``, status 1) with one line
        ``error: …`` on stderr instead of a traceback. Raises ``ValueError`` for a
        negative or non-finite ``retry_window``.
        """
        if retry_window is not None and not (math.isfinite(retry_window) and retry_window >= 0):
            raise ValueError(f"retry_window must be a finite number of seconds >= 0, got {retry_window!r}")
        try:
            self._connection_settings()
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
        try:
            asyncio.run(self.serve(announce=announce_on_stderr, retry_window=retry_window))
        except KeyboardInterrupt:
            return
        except (AuthenticationError, RemoteCallError, RemoteDisconnected, InvalidURI) as error:
            raise SystemExit(f"error: {error}") from None

    def session_url(self) -> str:
        """The ``/ws`` URL :meth:`serve` connects to: from ``url``, else ``$DISPATCH_URL``,
        else :data:`.session.DEFAULT_URL`. Raises ``ValueError`` for a malformed URL."""
        return websocket_url(self.url or os.environ.get(URL_ENV) or DEFAULT_URL)

    def serving_line(self) -> str:
        """``serving 'weather-service' (1 function) on ws://127.0.0.1:8000/ws``."""
        count = len(self._functions)
        return f"serving {self.name!r} ({count} function{'' if count == 1 else 's'}) on {self.session_url()}"

    async def serve(self, *, announce: Announce | None = None, retry_window: float | None = None) -> NoReturn:
        """Connect, register this remote, answer ``remote-call`` events; never returns.

        ``announce`` (if given) is called with :meth:`serving_line` after the first
        registration, with ``reconnected: `` and that line after each later one, and with
        ``remote 'name' is still registered; retrying in 0.5s`` each time the server
        still holds the name (without ``announce`` that is logged at INFO).

        On connection loss it reconnects and registers again, forever, waiting 0.5 s
        doubling up to 30 s plus up to 50 % random jitter; the delay starts over after
        each successful registration.

        Raises ``AuthenticationError`` when the server closes with 4401 or 4408 (a bad
        token: retrying cannot help), and ``RemoteCallError`` when ``remote-connect`` is
        refused for a reason retrying cannot fix: an invalid spec, or the name still
        held by another session ``retry_window`` seconds (``None``:
        :data:`REGISTER_RETRY_WINDOW`) after the first attempt. Raises
        ``RemoteDisconnected`` when another session of the user disconnected this remote
        (the server's ``remote-disconnected`` event): it is not registered again.
        Raises ``ValueError`` before connecting when the URL is malformed or there is no
        token (neither ``token`` nor ``$DISPATCH_TOKEN``).
        """
        self._disconnected = None
        attempt = 0
        registered_before = False
        while True:
            url, token = self._connection_settings()
            where = url
            if not (self.url or os.environ.get(URL_ENV)):
                where = f"{url} (the default: set {URL_ENV} or pass --server http(s)://host:port)"
            try:
                session = await Session.connect(url, token, on_event=self._on_event)
            except (OSError, InvalidHandshake) as error:  # unreachable, timeout, HTTP error
                problem = f"cannot connect to {where}: {error}"
            else:
                logger.info("connected to %s", url)
                try:
                    await self._register(
                        session, give_up=not registered_before, announce=announce, retry_window=retry_window
                    )
                    if announce is not None:
                        announce(("reconnected: " if registered_before else "") + self.serving_line())
                    registered_before = True
                    attempt = 0
                    await session.wait_closed()
                    if self._disconnected is not None:
                        raise RemoteDisconnected(
                            f"remote {self.name!r} was disconnected by another session: {self._disconnected}"
                        )
                    problem = f"connection to {url} lost (code {session.close_code})"
                except (ConnectionClosed, TimeoutError) as error:
                    reason = str(error) or "no reply in time"
                    problem = f"connection to {url} failed while registering: {reason}"
                finally:
                    await session.close()
            delay = min(RECONNECT_DELAY * 2**attempt, RECONNECT_DELAY_MAX)
            delay += random.uniform(0, delay / 2)  # noqa: S311 - jitter, not a secret
            attempt += 1
            logger.warning("%s; reconnecting in %.1fs", problem, delay)
            await asyncio.sleep(delay)

    def _connection_settings(self) -> tuple[str, str]:
        """``(session URL, token)`` as :meth:`serve` uses them for its next connection."""
        url = self.session_url()
        token = self.token or os.environ.get(TOKEN_ENV)
        if not token:
            raise ValueError(f"no API token for remote {self.name!r}: set {TOKEN_ENV} or give the Remote a token")
        return url, token

    async def _register(
        self, session: Session, *, give_up: bool, announce: Announce | None, retry_window: float | None
    ) -> None:
        """Send ``remote-connect``, retrying while the name is still held.

        With ``give_up`` the last refusal is raised as ``RemoteCallError`` after
        ``retry_window`` seconds (``None``: :data:`REGISTER_RETRY_WINDOW`); without it (a
        re-registration), the refusal ends this connection as ``TimeoutError`` so that
        :meth:`serve` reconnects later. Each retry is told to ``announce`` (the user waits on it), else logged at INFO.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (REGISTER_RETRY_WINDOW if retry_window is None else retry_window)
        delay = RECONNECT_DELAY
        while True:
            try:
                await session.request("remote-connect", {"remotename": self.name, "tools": self.specs})
                break
            except RemoteCallError as error:
                if "already connected" not in str(error):
                    raise
                if loop.time() + delay > deadline:
                    if give_up:
                        raise
                    raise TimeoutError(f"remote {self.name!r} is still connected elsewhere") from error
            notice = f"remote {self.name!r} is still registered; retrying in {delay:.1f}s"
            if announce is not None:
                announce(notice)
            else:
                logger.info("%s", notice)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_DELAY_MAX)
        count = len(self._functions)
        logger.info(
            "registered remote %r (%d function%s)",
            self.name,
            count,
            "" if count == 1 else "s",
        )

    def _on_event(self, session: Session, event: dict[str, Any]) -> None:
        if event.get("action") == "remote-disconnected" and event.get("remotename") == self.name:
            reason = str(event.get("reason") or "no reason given")
            logger.warning(
                "remote %r was disconnected by another session: %s; not serving it any more", self.name, reason
            )
            self._disconnected = reason
            closing = asyncio.create_task(session.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            return
        if event.get("action") != "remote-call":
            logger.debug("ignoring event %r", event.get("action"))
            return
        task = asyncio.create_task(self._answer(session, event))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _answer(self, session: Session, call: dict[str, Any]) -> None:
        """Run one ``remote-call`` event and send its ``remote-call-result``
        (docs/ws-protocol.md#remote-call-result)."""
        request_id = call.get("requestId")
        reply: dict[str, Any] = {
            "action": "remote-call-result",
            "requestId": request_id,
        }
        try:
            result = await self._invoke(call)
            try:
                frame = encode_message(reply | {"result": result})
            except MessageTooLarge:
                raise
            except (TypeError, ValueError) as error:  # NaN/Infinity (allow_nan=False), unserialisable
                raise ValueError(f"{call.get('function')!r} returned a value JSON cannot carry: {error}") from error
        except Exception as error:
            logger.info("call %s failed: %r", request_id, error)
            frame = encode_message(reply | {"error": f"{type(error).__name__}: {error}"[:ERROR_MAX_CHARS]})
        try:
            await session.send(frame)
        except (ConnectionClosed, AuthenticationError):
            logger.warning("result of call %s dropped: the connection closed", request_id)

    async def _invoke(self, call: dict[str, Any]) -> Any:
        """Call the named function with ``args`` as keyword arguments; return a JSON value."""
        name = call.get("function")
        function = self._functions.get(name) if isinstance(name, str) else None
        if function is None:
            raise LookupError(f"remote {self.name!r} has no function {name!r}")
        args = call.get("args") or {}
        if not isinstance(args, dict):
            raise TypeError(f"args must be a JSON object, not {type(args).__name__}")
        if function.is_async:
            value = await function.call(**args)
        else:
            value = await asyncio.to_thread(function.call, **args)
        return to_jsonable_python(value)


def announce_on_stderr(line: str) -> None:
    """The announcement of :meth:`Remote.run` and ``serve``: ``line`` on stderr, flushed."""
    print(line, file=sys.stderr, flush=True)
