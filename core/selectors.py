"""Reads of the core app, scoped to the caller."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.db.models import QuerySet
from django.utils import timezone

from core.models import ApiToken, ServerProcess


def api_tokens_for(*, user: User) -> QuerySet[ApiToken]:
    """``user``'s tokens, newest first (revoked ones included, for the record)."""
    return ApiToken.objects.filter(user=user).order_by("-created_at")


def alive_processes() -> QuerySet[ServerProcess]:
    """Processes whose heartbeat is younger than ``DISPATCH_PROCESS_TTL``."""
    cutoff = timezone.now() - timedelta(seconds=settings.PROCESS_TTL)
    return ServerProcess.objects.filter(heartbeat_at__gte=cutoff)
