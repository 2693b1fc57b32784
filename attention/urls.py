"""Routes of notifications: pages (``urlpatterns``, included at the root by
``dispatch/urls.py``) and ``/api/v1/notifications/…`` (``api_urlpatterns``)."""

from __future__ import annotations

from django.urls import path

from attention import api, views

urlpatterns = [
    path("settings/notifications/", views.notification_settings_page, name="notification-settings"),
    path("settings/notifications/test", views.notification_test, name="notification-test"),
    path("sw.js", views.service_worker, name="service-worker"),
    path("manifest.webmanifest", views.web_manifest, name="web-manifest"),
]

api_urlpatterns = [
    path("notifications", api.NotificationListView.as_view(), name="api-notifications"),
    path("notifications/settings", api.NotificationSettingsView.as_view(), name="api-notification-settings"),
    path(
        "notifications/push-subscriptions",
        api.PushSubscriptionsView.as_view(),
        name="api-notification-push-subscriptions",
    ),
    path("notifications/viewing", api.ViewingView.as_view(), name="api-notification-viewing"),
    path("notifications/test", api.NotificationTestView.as_view(), name="api-notification-test"),
]
