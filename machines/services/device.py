"""Device login (RFC 8628) and machine tokens (docs/shim-protocol.md#getting-a-token).

Codes: ``user_code`` is 8 characters from ``BCDFGHJKLMNPQRSTVWXZ`` shown as ``XXXX-XXXX``;
``device_code`` is 256-bit random; both stored as SHA-256 digests. A machine token is
minted when the shim polls after approval (shown once, in that response).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone
from limits import parse

from core.errors import DispatchError, InvalidRequest, RateLimited
from core.revocation import credentials_ended_on_commit
from core.services import generate_token, rate_limiter
from machines.device_schemas import DEVICE_GRANT_TYPE
from machines.models import DeviceAuthorization, MachineToken
from machines.services.connections import machine_revoke

USER_CODE_ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"
USER_CODE_LENGTH = 8
DEVICE_CODE_LIFETIME = 600  # seconds (expires_in)
POLL_INTERVAL = 5  # seconds (interval)
SLOW_DOWN_STEP = 5  # seconds added by slow_down (RFC 8628 §3.5)
MACHINE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")
ACTIVATION_FAILURES = "5 per 600 seconds"  # wrong codes per user on /machines/activate


class DeviceFlowError(DispatchError):
    """An RFC 6749 §5.2 / RFC 8628 §3.5 token-endpoint error (``error`` is the RFC word)."""

    def __init__(self, error: str, description: str) -> None:
        super().__init__("INVALID_REQUEST", description, {"error": error})
        self.error = error


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def normalize_user_code(text: str) -> str:
    """Upper-case ``text`` and drop spaces and dashes (``bcdf-ghjk`` → ``BCDFGHJK``)."""
    return re.sub(r"[\s-]+", "", text).upper()


def format_user_code(code: str) -> str:
    """``BCDFGHJK`` → ``BCDF-GHJK``."""
    return f"{code[:4]}-{code[4:]}"


@dataclass(frozen=True)
class DeviceCodeGrant:
    """The answer to ``POST /api/v1/machines/device/code`` (raw codes, shown once)."""

    authorization: DeviceAuthorization
    device_code: str
    user_code: str

    def as_response(self) -> dict[str, object]:
        base = f"{settings.PUBLIC_URL}/machines/activate"
        display = format_user_code(self.user_code)
        return {
            "device_code": self.device_code,
            "user_code": display,
            "verification_uri": base,
            "verification_uri_complete": f"{base}?user_code={display}",
            "expires_in": DEVICE_CODE_LIFETIME,
            "interval": self.authorization.interval,
        }


def _clean(value: object, field: str, limit: int, *, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise InvalidRequest(f"{field} must be a non-empty string")
    value = value.strip()
    if len(value) > limit:
        raise InvalidRequest(f"{field} must be at most {limit} characters")
    return value


@transaction.atomic
def device_authorization_start(
    *, machine_id: object, hostname: object, platform: object, arch: object
) -> DeviceCodeGrant:
    """Open a device authorization for a shim (RFC 8628 §3.1–3.2).

    ``machine_id`` is the shim's id (1–64 characters from letters, digits and ``._:-``),
    the rest describe the machine for the approval page. Raises ``InvalidRequest``.
    """
    machine = _clean(machine_id, "machine_id", 64)
    if not MACHINE_ID_PATTERN.fullmatch(machine):
        raise InvalidRequest("machine_id must be 1-64 characters from letters, digits and '._:-'")
    user_code = "".join(secrets.choice(USER_CODE_ALPHABET) for _ in range(USER_CODE_LENGTH))
    device_code = secrets.token_urlsafe(32)
    authorization = DeviceAuthorization.objects.create(
        device_code_digest=_digest(device_code),
        user_code_digest=_digest(user_code),
        machine_id=machine,
        hostname=_clean(hostname, "hostname", 255),
        platform=_clean(platform, "platform", 32),
        arch=_clean(arch, "arch", 32),
        interval=POLL_INTERVAL,
        expires_at=timezone.now() + timedelta(seconds=DEVICE_CODE_LIFETIME),
    )
    return DeviceCodeGrant(authorization=authorization, device_code=device_code, user_code=user_code)


@dataclass(frozen=True)
class IssuedMachineToken:
    token: MachineToken
    raw: str


def machine_token_create(*, user: User, machine_id: str) -> IssuedMachineToken:
    """Mint a machine token for ``user``'s ``machine_id`` (256-bit, shown once)."""
    raw = generate_token()
    token = MachineToken.objects.create(user=user, machine_id=machine_id, prefix=raw[:8], digest=_digest(raw))
    return IssuedMachineToken(token=token, raw=raw)


def device_token_poll(*, device_code: object, grant_type: object) -> IssuedMachineToken:
    """Poll for the token (RFC 8628 §3.4–3.5; docs/shim-protocol.md).

    ``grant_type`` must be ``urn:ietf:params:oauth:grant-type:device_code``: missing (or
    not a string) raises ``DeviceFlowError`` ``invalid_request``, another value
    ``unsupported_grant_type`` (RFC 6749 §5.2); both leave the authorization untouched (no
    poll is counted). Then ``authorization_pending``, ``slow_down`` (polled before
    ``interval`` seconds passed; the interval grows by 5 s), ``access_denied``,
    ``expired_token`` or ``invalid_grant`` (unknown or already used code). On approval
    returns the new machine token, once: the authorization is then consumed.
    """
    if not isinstance(grant_type, str) or not grant_type:
        raise DeviceFlowError("invalid_request", f"grant_type is required ({DEVICE_GRANT_TYPE})")
    if grant_type != DEVICE_GRANT_TYPE:
        raise DeviceFlowError(
            "unsupported_grant_type", f"grant_type {grant_type[:100]!r} is not supported; use {DEVICE_GRANT_TYPE}"
        )
    if not isinstance(device_code, str) or not device_code or len(device_code) > 200:
        raise DeviceFlowError("invalid_request", "device_code is required")
    outcome = _device_token_poll(device_code)
    # Raised after the commit: the poll time and a grown interval must be kept even
    # when the answer is an error (raising inside the transaction rolled them back).
    if isinstance(outcome, DeviceFlowError):
        raise outcome
    return outcome


@transaction.atomic
def _device_token_poll(device_code: str) -> IssuedMachineToken | DeviceFlowError:
    authorization = (
        DeviceAuthorization.objects.select_for_update().filter(device_code_digest=_digest(device_code)).first()
    )
    if authorization is None or authorization.status == DeviceAuthorization.Status.CONSUMED:
        return DeviceFlowError("invalid_grant", "unknown or already used device_code")
    now = timezone.now()
    if authorization.expires_at <= now:
        return DeviceFlowError("expired_token", "the device code expired; run login again")
    if authorization.status == DeviceAuthorization.Status.DENIED:
        return DeviceFlowError("access_denied", "the request was denied")
    if authorization.status == DeviceAuthorization.Status.APPROVED and authorization.user is not None:
        authorization.status = DeviceAuthorization.Status.CONSUMED
        authorization.last_polled_at = now
        authorization.save(update_fields=["status", "last_polled_at"])
        return machine_token_create(user=authorization.user, machine_id=authorization.machine_id)
    too_soon = authorization.last_polled_at is not None and now - authorization.last_polled_at < timedelta(
        seconds=authorization.interval
    )
    authorization.last_polled_at = now
    if too_soon:
        authorization.interval += SLOW_DOWN_STEP
        authorization.save(update_fields=["last_polled_at", "interval"])
        return DeviceFlowError("slow_down", f"poll at most every {authorization.interval} seconds")
    authorization.save(update_fields=["last_polled_at"])
    return DeviceFlowError("authorization_pending", "waiting for the user to approve the code")


def device_authorization_find(*, user: User, user_code: str) -> DeviceAuthorization:
    """The pending, unexpired authorization with ``user_code``, for ``user`` to decide.

    Case, spaces and dashes in ``user_code`` are ignored. Wrong codes are limited to 5
    per user per 10 minutes (``RateLimited``); a wrong, expired or decided code raises
    ``InvalidRequest`` with one message for all.
    """
    limit = parse(ACTIVATION_FAILURES)
    key = (settings.REDIS_PREFIX, "device-activation-failures", str(user.pk))
    if not rate_limiter().test(limit, *key):
        raise RateLimited("too many wrong codes; try again in a few minutes")
    code = normalize_user_code(user_code)
    authorization = None
    if len(code) == USER_CODE_LENGTH and set(code) <= set(USER_CODE_ALPHABET):
        authorization = DeviceAuthorization.objects.filter(
            user_code_digest=_digest(code), status=DeviceAuthorization.Status.PENDING, expires_at__gt=timezone.now()
        ).first()
    if authorization is None:
        rate_limiter().hit(limit, *key)
        raise InvalidRequest("that code is not valid or has expired")
    return authorization


@transaction.atomic
def device_authorization_decide(*, user: User, user_code: str, approve: bool) -> DeviceAuthorization:
    """Approve (the machine's token will belong to ``user``) or deny a pending code."""
    found = device_authorization_find(user=user, user_code=user_code)
    authorization = DeviceAuthorization.objects.select_for_update().get(pk=found.pk)
    if authorization.status != DeviceAuthorization.Status.PENDING:
        raise InvalidRequest("that code is not valid or has expired")
    authorization.status = DeviceAuthorization.Status.APPROVED if approve else DeviceAuthorization.Status.DENIED
    authorization.user = user if approve else None
    authorization.decided_at = timezone.now()
    authorization.save(update_fields=["status", "user", "decided_at"])
    return authorization


@transaction.atomic
def machine_tokens_revoke(*, token_ids: list[int]) -> int:
    """Revoke machine tokens (the admin's action): a token bound to a machine revokes that
    machine (``connections.machine_revoke``: its sockets close with 4401); an
    unbound one (a device login not finished) is stamped ``revoked_at``, and the
    revocation sweep is rung. Returns how many tokens were live. Already revoked ones are left."""
    live = MachineToken.objects.select_related("user").filter(pk__in=token_ids, revoked_at__isnull=True)
    tokens = list(live)
    for token in tokens:
        if token.machine_id:
            machine_revoke(user=token.user, machine_id=token.machine_id)
    still_live = MachineToken.objects.filter(pk__in=[token.pk for token in tokens], revoked_at__isnull=True)
    still_live.update(revoked_at=timezone.now())
    credentials_ended_on_commit()
    return len(tokens)
