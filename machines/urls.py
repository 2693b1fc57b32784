from __future__ import annotations

from django.urls import path

from machines import api, device_api, views

urlpatterns = [
    path("machines/", views.machines_page, name="machines"),
    path("machines/fragment", views.machines_fragment, name="machines-fragment"),
    path("machines/activate", views.activate_page, name="machines-activate"),
    path("machines/<str:machine_id>/revoke", views.machine_revoke, name="machine-revoke"),
    path("machines/default", views.machine_default, name="machine-default"),
    path("machines/<str:machine_id>/capabilities", views.machine_capabilities, name="machine-capabilities"),
]

api_urlpatterns = [
    path("machines/device/code", device_api.device_code, name="api-device-code"),
    path("machines/device/token", device_api.device_token, name="api-device-token"),
    path("machines", api.MachineListView.as_view(), name="api-machines"),
    path("machines/default", api.default_machine, name="api-machine-default"),
    path("machines/<str:machine_id>", api.MachineDetailView.as_view(), name="api-machine"),
    path("sessions/<str:session_id>/machines", api.SessionMachinesView.as_view(), name="api-session-machines"),
    path("sessions/<str:session_id>/ops", api.session_ops, name="api-session-ops"),
    path(
        "sessions/<str:session_id>/ops/<str:request_id>/cancel",
        api.session_op_cancel,
        name="api-session-op-cancel",
    ),
    path("sessions/<str:session_id>/pipe", api.session_pipe, name="api-session-pipe"),
    path("sessions/<str:session_id>/copy", api.session_copy, name="api-session-copy"),
]
