"""Sending one notification to one target: an Apprise URL (the ``apprise`` library) or a
Web Push subscription (``pywebpush``: aes128gcm encryption, RFC 8291 / RFC 8188, signed
with the instance's VAPID key, RFC 8292). Blocking network calls: run from the delivery
worker's thread (``attention.worker``), never from a request or an event loop.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import apprise
import requests
from django.conf import settings
from pywebpush import WebPushException, webpush

from attention.vapid import vapid_key
from core.errors import InvalidRequest

# Apprise's own log lines, without the time stamp (its reasons for a refusal).
_APPRISE_LOG = "%(message)s"


class DeliveryFailed(Exception):
    """A send that did not reach its target; the message says why (kept in ``last_error``)."""


class SubscriptionGone(DeliveryFailed):
    """The push service answered 404 or 410: the subscription expired (RFC 8030 §7.3)."""


@contextmanager
def _apprise_log_kept() -> Iterator[StringIO]:
    """Apprise's log lines of the block (WARNING and up), kept out of the server's log:
    a refusal is the user's answer, a failed send the worker logs itself with the reason."""
    logger = logging.getLogger("apprise")
    propagate, logger.propagate = logger.propagate, False
    try:
        with apprise.LogCapture(level=logging.WARNING, fmt=_APPRISE_LOG) as captured:
            yield captured
    finally:
        logger.propagate = propagate


def _apprise_reasons(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return " ".join(line if line.endswith((".", "!", "?")) else line + "." for line in lines[-3:])


def apprise_url_check(url: str) -> None:
    """Refuse an Apprise URL that apprise cannot load (``InvalidRequest`` with apprise's
    own reason, e.g. "An invalid Slack (second) Token (None) was specified."). Nothing is sent."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidRequest("an Apprise URL must be non-empty text")
    if "\x00" in url or len(url) > 2000:
        raise InvalidRequest("an Apprise URL must be at most 2000 characters, without NUL")
    with _apprise_log_kept() as captured:
        try:
            loaded = apprise.Apprise.instantiate(url.strip())
        except Exception as exc:  # a plugin choking on odd input refuses it like apprise would
            raise InvalidRequest(f"Apprise URL refused: {exc}", {"reason": str(exc)}) from None
    if loaded is None:
        reason = _apprise_reasons(captured.getvalue()) or "apprise does not know this URL"
        raise InvalidRequest(f"Apprise URL refused: {reason}", {"reason": reason})


def apprise_url_masked(url: str) -> str:
    """``url`` as apprise shows it with passwords hidden, without its query, and every
    path segment and user name longer than four characters cut to its first two (a
    topic or token is a secret too): ``ntfys://ntfy.sh/my…``."""
    loaded = apprise.Apprise.instantiate(url)
    shown = loaded.url(privacy=True) if loaded is not None else url
    parts = urlsplit(shown)

    def cut(segment: str) -> str:
        return segment if len(segment) <= 4 else segment[:2] + "…"

    netloc = parts.netloc
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        netloc = "@".join([":".join(cut(piece) for piece in user.split(":")), host])
    path = "/".join(cut(segment) for segment in parts.path.split("/"))
    return urlunsplit((parts.scheme, netloc, path, "", ""))


def apprise_send(*, url: str, title: str, body: str, link: str) -> None:
    """Send ``title`` and ``body`` (followed by a blank line and ``link``, so every
    service shows where to answer) to the Apprise ``url``. Raises ``DeliveryFailed``
    with apprise's reason."""
    notifier = apprise.Apprise()
    with _apprise_log_kept() as captured:
        if not notifier.add(url):
            raise DeliveryFailed(_apprise_reasons(captured.getvalue()) or "apprise could not load the URL")
        sent = notifier.notify(title=title, body=f"{body}\n\n{link}" if body else link)
    if not sent:
        raise DeliveryFailed(_apprise_reasons(captured.getvalue()) or "apprise could not send it")


# Push services answer these when a subscription is gone for good (RFC 8030 §7.3).
GONE_STATUSES = frozenset({404, 410})


def webpush_send(*, endpoint: str, p256dh: str, auth: str, payload: dict[str, Any], urgent: bool = False) -> None:
    """POST ``payload`` (JSON) to a browser's push ``endpoint``, encrypted for its keys
    (``p256dh``, ``auth``: base64url) per RFC 8291 and signed with the instance's VAPID key
    (``aud`` = the endpoint's origin, ``exp`` 12 h ahead, ``sub`` = ``DISPATCH_VAPID_SUBJECT``;
    RFC 8292). ``urgent`` asks for ``Urgency: high`` (RFC 8030 §5.3). TTL 24 h.

    Raises ``SubscriptionGone`` for a 404/410 answer, ``DeliveryFailed`` otherwise (a
    redirect included: it is not followed).
    """
    headers = {"Urgency": "high" if urgent else "normal"}
    # A push service answers, it never redirects (RFC 8030 §5): a redirect would take the
    # server's request past push_endpoint_check to wherever it points (an internal address).
    session = requests.Session()
    session.max_redirects = 0
    try:
        webpush(
            requests_session=session,
            subscription_info={"endpoint": endpoint, "keys": {"p256dh": p256dh, "auth": auth}},
            data=json.dumps(payload, separators=(",", ":")),
            vapid_private_key=vapid_key(),
            vapid_claims={"sub": settings.VAPID_SUBJECT},  # a fresh dict: webpush fills aud and exp in
            ttl=86400,
            timeout=settings.NOTIFY_SEND_TIMEOUT,
            headers=headers,
        )
    except WebPushException as exc:
        status = exc.response.status_code if exc.response is not None else None
        reason = re.sub(r"\s+", " ", str(exc)).strip()[:500]
        if status in GONE_STATUSES:
            raise SubscriptionGone(f"push service answered {status}: the subscription expired") from None
        raise DeliveryFailed(reason) from None
    except requests.TooManyRedirects:
        raise DeliveryFailed("the push service answered with a redirect, which is not followed") from None
    except Exception as exc:  # network errors (requests), bad keys
        raise DeliveryFailed(f"{type(exc).__name__}: {exc}"[:500]) from None
    finally:
        session.close()
