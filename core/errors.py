"""One error vocabulary for every edge (docs/architecture.md#errors).

``DispatchError(code, message, details)`` carries an UPPER_SNAKE code; each edge renders
it in its own shape: REST as
``{"error": {"code", "message", "details"}}`` with ``http_status``, ``/ws`` as the plain
``message`` string, the shim consumer as an ``ERROR`` frame, MCP as an ``isError`` result.
"""

from __future__ import annotations

from typing import Any

from core.outage import SERVICES, tracker

# HTTP status per code (docs/architecture.md#errors); unknown codes map to 400.
HTTP_STATUS: dict[str, int] = {
    "INVALID_REQUEST": 400,
    "VALIDATION_ERROR": 400,
    "PATH_OUTSIDE_ALLOWED_ROOT": 400,
    "PATH_EXISTS": 400,
    "PATH_NOT_EMPTY": 400,
    "IS_A_DIRECTORY": 400,
    "ENCODING_ERROR": 400,
    "UNSUPPORTED_OPERATION": 400,
    "INVALID_RESPONSE": 502,
    "NOT_AUTHENTICATED": 401,
    "AUTHENTICATION_FAILED": 401,
    "CAPABILITY_NOT_GRANTED": 403,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "OPERATION_NOT_FOUND": 404,
    "MACHINE_NOT_ATTACHED": 404,
    "PATH_NOT_FOUND": 404,
    "REMOTE_NOT_CONNECTED": 404,
    "METHOD_NOT_ALLOWED": 405,
    "CONFLICT": 409,
    "OPERATION_EXISTS": 409,
    "CANCELLED": 409,
    "MACHINE_AMBIGUOUS": 409,
    "REMOTE_ALREADY_CONNECTED": 409,
    "FILE_TOO_LARGE": 413,
    "IDEMPOTENCY_KEY_REUSED": 422,
    "RATE_LIMITED": 429,
    "REMOTE_ERROR": 502,
    "REMOTE_DISCONNECTED": 502,
    "MACHINE_UNREACHABLE": 502,
    "OUTPUT_LOST": 502,
    "REMOTE_BUSY": 503,
    "SHIM_OVERLOADED": 503,
    "SHUTTING_DOWN": 503,
    "TEMPORARILY_UNAVAILABLE": 503,
    "TIMEOUT": 504,
}


class DispatchError(Exception):
    """A failure fit to show a user or a model.

    ``code`` is an UPPER_SNAKE word from ``HTTP_STATUS``; ``message`` a sentence that says
    what was wrong; ``details`` a JSON-serialisable dict (never secrets).
    """

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}

    @property
    def http_status(self) -> int:
        """The HTTP status this error maps to (400 for codes without a mapping)."""
        return HTTP_STATUS.get(self.code, 400)

    def as_dict(self) -> dict[str, Any]:
        """The REST / peer API body: ``{"error": {"code", "message", "details"}}``."""
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r})"


class InvalidRequest(DispatchError):
    """Input that does not fit the operation (400)."""

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__("INVALID_REQUEST", message, details)


class NotFound(DispatchError):
    """The object does not exist for this caller (404); never says whether it exists for another."""

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__("NOT_FOUND", message, details)


class RateLimited(DispatchError):
    """Too many attempts (429)."""

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__("RATE_LIMITED", message, details)


class TemporarilyUnavailable(DispatchError):
    """A service this process needs (the database, the channel layer) cannot be reached (503).

    The request did nothing that needs undoing; the client retries later (docs/operating.md#health:
    REST answers 503, never 500, while Redis or the database is down).
    """

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__("TEMPORARILY_UNAVAILABLE", message, details)


DATABASE_UNAVAILABLE = "the database cannot be reached; retry in a moment"
DATABASE_BUSY = "every database connection of this server process is busy; retry in a moment"
CHANNEL_LAYER_UNAVAILABLE = "the channel layer (Redis) cannot be reached; retry in a moment"


def dependency_timed_out(service: str, seconds: float) -> str:
    """The message of a call to ``service`` that got no answer within ``seconds``:
    ``"the channel layer (Redis) did not answer within 2s; retry in a moment"``."""
    return f"{SERVICES.get(service, service)} did not answer within {seconds:g}s; retry in a moment"


class ChannelLayerTimeout(Exception):
    """Mixed into ``redis.exceptions.TimeoutError`` by ``core.channel_layer`` when a layer
    call outlives ``DISPATCH_DEPENDENCY_TIMEOUT`` (a frozen Redis accepts connections and
    never answers); ``seconds`` is that deadline."""

    seconds: float = 0.0


def channel_layer_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` means the channel layer (Redis) cannot be reached right now:
    ``redis.exceptions.ConnectionError`` (refused, reset, "No connection available.") or
    ``redis.exceptions.TimeoutError`` (a socket timeout, or ``core.channel_layer``'s
    deadline). Always False without the redis package."""
    try:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
    except ImportError:  # pragma: no cover - redis comes with channels-redis
        return False
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError))


def _redis_timeout(exc: BaseException) -> bool:
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return isinstance(exc, RedisTimeoutError)


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` means the database cannot be reached or has no connection free:
    ``django.db.OperationalError`` or ``InterfaceError`` (a refused or dropped
    connection, a pool checkout that timed out)."""
    from django.db import InterfaceError, OperationalError

    return isinstance(exc, (OperationalError, InterfaceError))


def unavailable_error(exc: BaseException) -> TemporarilyUnavailable | None:
    """The 503 ``TEMPORARILY_UNAVAILABLE`` error for an outage exception, else ``None``.

    Outages: the channel layer unreachable or silent past its deadline
    (``channel_layer_unavailable``), the database unreachable or its connection pool
    exhausted (``database_unavailable``; a psycopg_pool ``PoolTimeout`` arrives wrapped in
    ``OperationalError``). The message names which service is missing (and the deadline
    it missed: "the channel layer (Redis) did not answer within 2s; retry in a moment");
    ``details.service`` is ``"channel_layer"`` or ``"database"``. Every edge maps errors
    through here, so the outage is also noted in ``core.outage.tracker`` (one WARNING per
    outage, docs/operating.md#health). The edges answer it 503 with ``Retry-After``.
    """
    if isinstance(exc, TemporarilyUnavailable):
        return exc
    if channel_layer_unavailable(exc):
        tracker.failed("channel_layer", exc)
        message = CHANNEL_LAYER_UNAVAILABLE
        if isinstance(exc, ChannelLayerTimeout):
            message = dependency_timed_out("channel_layer", exc.seconds)
        elif _redis_timeout(exc):  # a socket timeout of a sync client (rate limits, the router's cache)
            from django.conf import settings

            message = dependency_timed_out("channel_layer", settings.DEPENDENCY_TIMEOUT)
        return TemporarilyUnavailable(message, {"service": "channel_layer"})
    if database_unavailable(exc):
        tracker.failed("database", exc)
        busy = type(exc.__cause__).__name__ == "PoolTimeout"
        return TemporarilyUnavailable(DATABASE_BUSY if busy else DATABASE_UNAVAILABLE, {"service": "database"})
    return None
