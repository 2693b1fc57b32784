"""``/favicon.ico``: Dispatch's icon, ``static/favicon.svg``, at the path every browser asks
for on every page (WHATWG HTML "rel=icon": without a ``<link rel="icon">`` a browser falls
back to ``/favicon.ico``), so that it gets an icon instead of a 404 in the server's log.

Pages name the SVG itself with ``<link rel="icon">``; this answers the browsers (and
bookmark and feed readers) that ask for the fixed path anyway. Included from
``dispatch/urls.py`` as its own URLconf (``urlpatterns`` below).
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.views.decorators.http import require_safe

FAVICON = Path(settings.BASE_DIR) / "static" / "favicon.svg"
CONTENT_TYPE = "image/svg+xml"
MAX_AGE = 86_400
"""Seconds a browser may keep the icon (it asks again at most once a day)."""

# Read once at startup: a few hundred bytes, served from memory without file I/O per request.
_ICON = FAVICON.read_bytes()


@login_not_required
@require_safe
async def favicon_ico(request: HttpRequest) -> HttpResponse:
    """``GET``/``HEAD /favicon.ico``: 200, ``image/svg+xml``, ``static/favicon.svg``'s bytes,
    cacheable for :data:`MAX_AGE` seconds; no login needed (an icon is not user data).
    Other methods: 405 (``require_safe``)."""
    response = HttpResponse(_ICON, content_type=CONTENT_TYPE)
    response["Cache-Control"] = f"public, max-age={MAX_AGE}"
    return response


urlpatterns = [path("favicon.ico", favicon_ico, name="favicon")]
