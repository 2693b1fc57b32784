"""Idempotency-Key receipts of the peer API (docs/peers.md#authentication).

Every state-changing peer POST carries an ``Idempotency-Key`` (a captured request
replayed inside the signature's time window must do nothing new). Before acting, the
receiver records a ``PeerReceipt`` keyed by (peer, key) with the route and a digest of
the body; when done it stores the answer in it.

- same key, same route and body, answer stored → the stored answer again;
- same key, another route or body → 422 ``IDEMPOTENCY_KEY_REUSED``;
- same key while the first request is still being processed → 409 ``CONFLICT`` with
  ``details.in_progress = true`` (decided: the views are short and synchronous, so the
  receiver does not wait; the sender may retry with the same key and then gets the first
  answer);
- the first request failed (any error) → the receipt is removed, so a retry is judged
  afresh (a message to an agent that is gone is 409 and keeps no receipt, docs/peers.md#messages).

Two ways to use it: ``receipt_open`` / ``receipt_close`` inside the caller's transaction
(the message route: the receipt and the message commit or roll back together, so a
concurrent duplicate waits on the unique index and then sees the finished receipt), or
``run_once`` (launch, stop, archive: the receipt is committed before acting because a
tmux session outlives any transaction).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction
from django.http import HttpRequest

from core.errors import DispatchError, InvalidRequest
from peers.models import Peer, PeerReceipt

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
# Printable ASCII without spaces, 1–100 characters (the column's length); a UUID fits.
_KEY = re.compile(r"[\x21-\x7e]{1,100}")


class IdempotencyKeyReused(DispatchError):
    """The key was already used for another route or body (422)."""

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__("IDEMPOTENCY_KEY_REUSED", message, details)

    @property
    def http_status(self) -> int:
        """Always 422 (Unprocessable Content), whatever ``core.errors.HTTP_STATUS`` says."""
        return 422


@dataclass(frozen=True)
class Answer:
    """A peer API answer: HTTP ``status`` and JSON ``body``; ``replayed`` when it came from
    an earlier request's receipt."""

    status: int
    body: dict[str, Any]
    replayed: bool = False


def idempotency_key_of(request: HttpRequest) -> str:
    """The request's ``Idempotency-Key`` header (stripped).

    Raises ``InvalidRequest`` (400) when it is missing, empty, longer than 100
    characters or not printable ASCII.
    """
    key = request.headers.get(IDEMPOTENCY_KEY_HEADER, "").strip()
    if not key:
        raise InvalidRequest("the Idempotency-Key header is required on this route (docs/peers.md#authentication)")
    if not _KEY.fullmatch(key):
        raise InvalidRequest("Idempotency-Key must be 1 to 100 printable ASCII characters without spaces")
    return key


def body_digest(body: Any) -> str:
    """SHA-256 hex of the canonical JSON of ``body`` (sorted keys, no spaces): two bodies
    that parse alike have the same digest whatever their key order or whitespace."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def _replay(receipt: PeerReceipt, *, route: str, digest: str) -> Answer:
    if receipt.route != route or receipt.body_digest != digest:
        raise IdempotencyKeyReused(
            "this Idempotency-Key was already used for a different request",
            {"idempotency_key": receipt.idempotency_key},
        )
    if receipt.response_status is None:
        raise DispatchError(
            "CONFLICT",
            "a request with this Idempotency-Key is still being processed; retry it shortly",
            {"idempotency_key": receipt.idempotency_key, "in_progress": True},
        )
    return Answer(status=receipt.response_status, body=dict(receipt.response_body or {}), replayed=True)


def receipt_open(*, peer: Peer, key: str, route: str, body: Any) -> PeerReceipt | Answer:
    """Record an in-progress receipt for (``peer``, ``key``), or return the earlier answer.

    Returns the new ``PeerReceipt`` (``response_status`` null) when the key is new, else
    the stored ``Answer`` (``replayed=True``). Runs in a savepoint: inside the caller's
    transaction the receipt commits or rolls back with the caller's work. Raises
    ``IdempotencyKeyReused`` (422) for another route/body under the key and
    ``DispatchError("CONFLICT")`` (409, ``details.in_progress``) while the first request
    under the key is unfinished.
    """
    digest = body_digest(body)
    try:
        with transaction.atomic():
            return PeerReceipt.objects.create(peer=peer, idempotency_key=key, route=route, body_digest=digest)
    except IntegrityError:
        existing = PeerReceipt.objects.filter(peer=peer, idempotency_key=key).first()
        if existing is None:  # removed between our insert and this read: the first request failed
            raise DispatchError(
                "CONFLICT",
                "a request with this Idempotency-Key was being processed; retry it",
                {"idempotency_key": key, "in_progress": True},
            ) from None
        return _replay(existing, route=route, digest=digest)


def receipt_close(*, receipt: PeerReceipt, answer: Answer) -> None:
    """Store ``answer`` in ``receipt`` (what a repeated key gets from now on)."""
    PeerReceipt.objects.filter(pk=receipt.pk).update(response_status=answer.status, response_body=answer.body)


def receipt_discard(*, receipt: PeerReceipt) -> None:
    """Remove ``receipt`` (the request failed: a retry under the key is judged afresh)."""
    PeerReceipt.objects.filter(pk=receipt.pk).delete()


def run_once(*, peer: Peer, key: str, route: str, body: Any, act: Callable[[], Answer]) -> Answer:
    """Do ``act()`` at most once per (``peer``, ``key``) and return its answer.

    The receipt is committed before ``act`` runs (call this outside any transaction), the
    answer stored after it. A repeated key returns the stored answer with
    ``replayed=True`` without calling ``act``. If ``act`` raises, the receipt is removed and
    the exception propagates. Raises as ``receipt_open``.
    """
    opened = receipt_open(peer=peer, key=key, route=route, body=body)
    if isinstance(opened, Answer):
        return opened
    try:
        answer = act()
    except BaseException:
        receipt_discard(receipt=opened)
        raise
    receipt_close(receipt=opened, answer=answer)
    return answer
