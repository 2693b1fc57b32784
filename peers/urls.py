"""URL map of the peers app: the peer API under ``/api/v1/peers/`` and the Linked instances pages.

Each part lives in its own module (pairing, the peer API, the mirroring stream, the
user-facing peer management API and pages) and is listed here.
"""

from __future__ import annotations

from django.urls import URLPattern, URLResolver

from peers import pairing_api, peer_api, stream, views

api_urlpatterns: list[URLPattern | URLResolver] = [  # mounted under /api/v1/
    *stream.api_urlpatterns,
    *pairing_api.api_urlpatterns,
    *peer_api.api_urlpatterns,
]
urlpatterns: list[URLPattern | URLResolver] = [*views.urlpatterns]  # pages
