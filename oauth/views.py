"""The discovery documents (docs/mcp.md#oauth): RFC 8414 authorization server metadata of
the issuer ``<public URL>/oauth`` at ``/.well-known/oauth-authorization-server/oauth``
(RFC 8414 §3.1, and at ``/oauth/.well-known/oauth-authorization-server``, where some clients look), and
RFC 9728 protected resource metadata of ``/mcp/oauth`` at
``/.well-known/oauth-protected-resource/mcp/oauth``.

Nothing at the root ``/.well-known/oauth-authorization-server`` or
``/.well-known/oauth-protected-resource``: they would describe the origin as a whole, and a
client that finds OAuth there for ``/mcp`` drops the header token it was configured with
(``/mcp`` takes header tokens only).
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views.decorators.csrf import csrf_exempt
from oauth2_provider.views import OAuthProtectedResourceMetadataView, OAuthServerMetadataView
from oauth2_provider.views import TokenView as LibraryTokenView

from oauth.models import OAuthPolicy
from oauth.validators import family_refused


@method_decorator(csrf_exempt, name="dispatch")
class ServerMetadataView(OAuthServerMetadataView):
    """RFC 8414 metadata: django-oauth-toolkit's document, with the registration endpoint
    and ``client_id_metadata_document_supported`` as the admin's switches say now."""

    def get(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        response = super().get(request, *args, **kwargs)
        data = json.loads(response.content)
        policy = OAuthPolicy.current()
        if not policy.dcr_enabled:
            data.pop("registration_endpoint", None)
        data["client_id_metadata_document_supported"] = bool(policy.cimd_enabled)
        answer = JsonResponse(data)
        answer["Access-Control-Allow-Origin"] = "*"
        answer["Cache-Control"] = "no-store"  # the switches change without a deploy
        return answer


@method_decorator(csrf_exempt, name="dispatch")
class ResourceMetadataView(OAuthProtectedResourceMetadataView):
    """RFC 9728 metadata of ``/mcp/oauth``: ``resource`` is its public URL byte for byte
    (``settings.MCP_OAUTH_RESOURCE``), the one authorization server this instance."""

    def get_resource(self, request: HttpRequest) -> str:
        return str(settings.MCP_OAUTH_RESOURCE)

    def get_authorization_servers(self, request: HttpRequest) -> list[str]:
        return [str(settings.OAUTH_ISSUER)]


class TokenView(LibraryTokenView):
    """``POST /oauth/token/``: the library's token endpoint, and the revocation of a token
    family whose refresh token was used a third time while others were refreshing it
    (``DispatchOAuth2Validator._sibling_pair``)."""

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        with family_refused():
            response: HttpResponse = super().post(request, *args, **kwargs)
        if response.status_code >= 400 and not response.get("Content-Type", "").startswith("application/json"):
            # An error raised while saving (a third use found under the lock) reaches the
            # library's view without oauthlib's headers: RFC 6749 §5.2 wants JSON, uncached.
            response["Content-Type"] = "application/json"
            response["Cache-Control"] = "no-store"
            response["Pragma"] = "no-cache"
        return response
