"""OpenAPI (drf-spectacular) description of Dispatch's authentication."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """``Authorization: Bearer <api token>`` in the OpenAPI schema."""

    target_class = "dispatch.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A user API token (Settings page or POST /api/v1/auth/token).",
        }
