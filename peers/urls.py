"""URL map of the peers app: the peer API under ``/api/v1/peers/`` and the Linked instances pages.

Each part lives in its own module (pairing, the peer API, the mirroring stream, the
user-facing peer management API and pages) and is listed here.
"""

from __future__ import annotations

from django.urls import URLPattern, URLResolver

from peers import stream

api_urlpatterns: list[URLPattern | URLResolver] = [*stream.api_urlpatterns]  # mounted under /api/v1/
urlpatterns: list[URLPattern | URLResolver] = []  # pages
