"""DRF content negotiation for the API (``REST_FRAMEWORK["DEFAULT_CONTENT_NEGOTIATION_CLASS"]``).

Its own module: DRF reads the setting while ``rest_framework.views`` is imported, so the
class must not live beside the views.
"""

from __future__ import annotations

from collections.abc import Iterable

from rest_framework import exceptions
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request


class JsonFallbackNegotiation(DefaultContentNegotiation):
    """DRF's content negotiation, except that an ``Accept`` no renderer satisfies gets the
    first renderer (JSON) instead of 406: RFC 9110 §12.5.1 lets a server disregard
    ``Accept``, every client of this API reads JSON, and the schema then needs no 406 on
    every route (schemathesis found it undocumented). An unknown ``?format=`` is still 404."""

    def select_renderer(
        self, request: Request, renderers: Iterable[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        """The renderer and media type for ``request``; JSON where DRF would raise ``NotAcceptable``."""
        renderers = list(renderers)
        try:
            return super().select_renderer(request, renderers, format_suffix)
        except exceptions.NotAcceptable:
            return renderers[0], renderers[0].media_type
