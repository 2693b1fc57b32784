from __future__ import annotations

from django.urls import path

from remotes import api, views

urlpatterns = [
    path("remotes/", views.remotes_page, name="remotes"),
    path("remotes/fragment", views.remotes_fragment, name="remotes-fragment"),
    path("remotes/call", views.remote_call_form, name="remotes-call"),
]

api_urlpatterns = [
    path("remotes", api.RemoteListView.as_view(), name="api-remotes"),
    path("remotes/<path:remotename>/call", api.remote_call_api, name="api-remote-call"),
]
