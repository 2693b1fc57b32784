"""This process's Prometheus metrics: the registry, what the code counts, and who may read it.

Served at ``/metrics`` by ``dispatch.metrics`` (docs/metrics.md lists every family). Every
number here is of *this process*: counters and histograms live in its memory and start at
zero when it starts; the gauges computed from rows at scrape time (``dispatch.metrics``)
count what this process holds. Nothing is shared between processes, so behind a load
balancer each process is scraped directly.

The code records through three calls, each one line at its site:

- ``observe_remote_calls`` — decorates ``remotes.services.remote_call``;
- ``machine_operation_observed`` — ``machines.services.operations.machine_op``'s ``finally``;
- ``loop_error_counted`` — ``core.realtime.LoopHealth.failed``, which every background
  loop reports its failed passes to.

Labels hold bounded values only: an error code outside Dispatch's vocabulary
(``core.errors.HTTP_STATUS``) is counted as ``OTHER``, so a shim or remote cannot make a
series per string it invents.

Access (decided by the view, ``dispatch.metrics``): a client whose address is in
``DISPATCH_METRICS_ALLOW`` (``address_allowed``), or a staff user's API token.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, ParamSpec, TypeVar

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
)

from core.errors import HTTP_STATUS, DispatchError, unavailable_error

REGISTRY = CollectorRegistry(auto_describe=True)
"""Dispatch's own registry (not prometheus_client's global one, which any imported library
may fill): the metrics below plus the standard ``process_*`` and ``python_*`` families."""
for _standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    REGISTRY.register(_standard)

# Seconds: from a millisecond relay to a remote call's 300 s limit and a command's 600 s.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

OK = "ok"
OTHER = "OTHER"
CANCELLED = "CANCELLED"
INTERNAL_ERROR = "INTERNAL_ERROR"
# Codes beyond HTTP_STATUS that failures carry: the shim's own (machines/shim/protocol.py
# ErrorCode.INTERNAL_ERROR) and machine_op's fallback for an ERROR frame without a code.
_EXTRA_CODES = frozenset({INTERNAL_ERROR, "MACHINE_ERROR", CANCELLED})

REMOTE_CALLS = Counter(
    "dispatch_remote_calls",
    "Remote calls started in this process, by result: ok or the error code (docs/ws-protocol.md#remote-call).",
    ["result"],
    registry=REGISTRY,
)
REMOTE_CALL_SECONDS = Histogram(
    "dispatch_remote_call_duration_seconds",
    "Time from a remote call's start to its result or error, by outcome (ok, error).",
    ["outcome"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
MACHINE_OPERATIONS = Counter(
    "dispatch_machine_operations",
    "Machine operations routed by this process, by operation type and result: ok or the error code "
    "(docs/shim-protocol.md#errors).",
    ["operation", "result"],
    registry=REGISTRY,
)
MACHINE_OPERATION_SECONDS = Histogram(
    "dispatch_machine_operation_duration_seconds",
    "Time from routing a machine operation to its response or error, by operation type and outcome (ok, error).",
    ["operation", "outcome"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
LOOP_ERRORS = Counter(
    "dispatch_background_loop_errors",
    "Failed passes of this process's background loops and their doorbells, by loop (core.realtime.LoopHealth).",
    ["loop"],
    registry=REGISTRY,
)


# Labelled children by (metric, label values): ``.labels()`` takes a lock and builds its key
# on every call, and a remote call records two. Every label value is bounded (the module
# docstring), so this stays small; the cap is only a guard.
_CHILDREN: dict[tuple[object, tuple[str, ...]], Any] = {}
_CHILDREN_CAP = 4096


def _child(metric: Counter | Histogram, *values: str) -> Any:
    """``metric.labels(*values)`` (values in the metric's label order), looked up once."""
    key = (metric, values)
    child = _CHILDREN.get(key)
    if child is None:
        if len(_CHILDREN) >= _CHILDREN_CAP:
            _CHILDREN.clear()
        child = _CHILDREN[key] = metric.labels(*values)
    return child


def result_label(failure: BaseException | None) -> str:
    """The ``result`` label of a finished call: ``ok`` without ``failure``; else the
    ``DispatchError``'s code when it is one of Dispatch's (``OTHER`` when it is not),
    ``TEMPORARILY_UNAVAILABLE`` for a database or channel-layer outage, ``CANCELLED`` when
    the caller went away, ``INTERNAL_ERROR`` for anything else."""
    if failure is None:
        return OK
    if isinstance(failure, DispatchError):
        code = failure.code
        return code if code in HTTP_STATUS or code in _EXTRA_CODES else OTHER
    if isinstance(failure, asyncio.CancelledError):
        return CANCELLED
    outage = unavailable_error(failure)
    return outage.code if outage is not None else INTERNAL_ERROR


Params = ParamSpec("Params")
Result = TypeVar("Result")


def observe_remote_calls(call: Callable[Params, Awaitable[Result]]) -> Callable[Params, Awaitable[Result]]:
    """Decorate the remote call (an ``async def``): each call is counted in
    ``dispatch_remote_calls_total{result}`` and timed in
    ``dispatch_remote_call_duration_seconds{outcome}``, whether it returns or raises
    (what it raises is raised unchanged)."""

    @functools.wraps(call)
    async def observed(*args: Params.args, **kwargs: Params.kwargs) -> Result:
        started = time.monotonic()
        failure: BaseException | None = None
        try:
            return await call(*args, **kwargs)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            result = result_label(failure)
            _child(REMOTE_CALLS, result).inc()
            _child(REMOTE_CALL_SECONDS, OK if result == OK else "error").observe(time.monotonic() - started)

    return observed


def machine_operation_observed(*, operation: str, ok: bool, failure: BaseException | None, seconds: float) -> None:
    """Count and time one routed machine operation: ``operation`` is its type (one of
    ``machines.protocol.CALLER_OPERATIONS``, checked before routing), ``ok`` whether the
    shim answered with a response, ``failure`` the exception on its way out otherwise
    (its code is the result), ``seconds`` from routing to the answer."""
    result = OK if ok else result_label(failure or DispatchError(INTERNAL_ERROR, "failed"))
    _child(MACHINE_OPERATIONS, operation, result).inc()
    _child(MACHINE_OPERATION_SECONDS, operation, OK if ok else "error").observe(seconds)


def loop_error_counted(loop: str) -> None:
    """Count one failed pass of the background loop named ``loop`` (a fixed name such as
    ``reaper`` or ``outbox drain pass``, never one carrying an id)."""
    _child(LOOP_ERRORS, loop).inc()


# --- access --------------------------------------------------------------------------------

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def address_allowed(address: str, networks: Iterable[Network]) -> bool:
    """Whether the client ``address`` (``REMOTE_ADDR``: the TCP peer, or with
    ``DISPATCH_BEHIND_PROXY`` the first ``X-Forwarded-For`` entry the proxy wrote) lies in
    one of ``networks`` (``DISPATCH_METRICS_ALLOW``). An IPv4 client seen
    as an IPv4-mapped IPv6 address (``::ffff:127.0.0.1``, a dual-stack listener) counts as
    its IPv4 address; an empty or unparsable address (a Unix socket) is never allowed."""
    try:
        ip = ipaddress.ip_address(address.strip())
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip.version == network.version and ip in network for network in networks)
