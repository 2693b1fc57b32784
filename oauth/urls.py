"""OAuth routes (docs/mcp.md#oauth). Under the ``oauth2_provider`` namespace, which
django-oauth-toolkit's metadata view reverses to advertise its endpoints."""

from django.urls import path
from oauth2_provider import views as dot

from oauth import pages, views
from oauth.consent import ConsentView
from oauth.registration import RegistrationManagementView, RegistrationView

app_name = "oauth2_provider"

urlpatterns = [
    path(
        ".well-known/oauth-authorization-server/oauth",
        views.ServerMetadataView.as_view(),
        name="oauth-server-metadata",
    ),
    path("oauth/.well-known/oauth-authorization-server", views.ServerMetadataView.as_view()),
    path(
        ".well-known/oauth-protected-resource/mcp/oauth",
        views.ResourceMetadataView.as_view(),
        name="oauth-resource-metadata-path",
    ),
    path("oauth/authorize/", ConsentView.as_view(), name="authorize"),
    path("oauth/token/", views.TokenView.as_view(), name="token"),
    path("oauth/revoke/", dot.RevokeTokenView.as_view(), name="revoke-token"),
    path("oauth/register/", RegistrationView.as_view(), name="dcr-register"),
    path(
        "oauth/register/<str:client_id>/",
        RegistrationManagementView.as_view(),
        name="dcr-register-management",
    ),
    # The settings page's OAuth section (oauth.pages; docs/mcp.md#oauth-connected-applications).
    path("settings/oauth/<int:application_id>/revoke/", pages.connection_revoke_view, name="oauth-connection-revoke"),
    path(
        "settings/oauth/users/<int:user_id>/<int:application_id>/revoke/",
        pages.connection_revoke_view,
        name="oauth-connection-revoke-user",
    ),
    path("settings/oauth/policy/", pages.policy_view, name="oauth-policy"),
]
