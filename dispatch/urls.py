"""URL map: pages, ``/api/v1``, the OpenAPI schema and its two readers (Swagger UI at
``/api/docs/``, Redoc at ``/api/redoc/``), the admin, ``/healthz``, ``/metrics``, ``/downloads/``
and ``/favicon.ico``."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from agents.urls import api_urlpatterns as agent_api_urls
from attention.urls import api_urlpatterns as attention_api_urls
from core import api, views
from dispatch import downloads
from dispatch.metrics import metrics_view
from machines.urls import api_urlpatterns as machine_api_urls
from peers.urls import api_urlpatterns as peer_api_urls
from remotes.urls import api_urlpatterns as remote_api_urls

api_v1 = [
    path("auth/token", api.TokenObtainView.as_view(), name="api-token-obtain"),
    path("auth/tokens", api.TokenListView.as_view(), name="api-token-list"),
    path("auth/tokens/<int:token_id>", api.TokenRevokeView.as_view(), name="api-token-revoke"),
    *remote_api_urls,
    *machine_api_urls,
    *agent_api_urls,
    *peer_api_urls,
    *attention_api_urls,
]

urlpatterns = [
    path("", include("agents.page_urls")),
    path("login/", views.login_view, name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("settings/", views.settings_page, name="settings"),
    path("settings/tokens/<int:token_id>/revoke", views.token_revoke, name="token-revoke"),
    path("healthz", views.healthz, name="healthz"),
    path("downloads/", downloads.downloads_page, name="downloads"),
    path("downloads/<str:filename>", downloads.download_file, name="download"),
    path("metrics", metrics_view, name="metrics"),
    path("", include("dispatch.favicon")),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path(
        "api/docs/",
        views.anonymous_browser_to_login(SpectacularSwaggerView.as_view(url_name="api-schema")),
        name="api-docs",
    ),
    path(
        "api/redoc/",
        views.anonymous_browser_to_login(
            SpectacularRedocView.as_view(url_name="api-schema", template_name="dispatch/redoc.html")
        ),
        name="api-redoc",
    ),
    path("admin/", admin.site.urls),
    path("", include("remotes.urls")),
    path("", include("machines.urls")),
    path("", include("peers.urls")),
    path("", include("attention.urls")),
    path("", include("oauth.urls")),
]

handler400 = "core.views.bad_request"
handler403 = "core.views.permission_denied"
handler404 = "dispatch.not_found.not_found"
handler500 = "core.views.server_error"
