"""Page routes of the agents (``/`` and ``/agents/<id>/``)."""

from __future__ import annotations

from django.urls import path

from agents import views

urlpatterns = [
    path("", views.agents_page, name="agents"),
    path("agents/fragment", views.agents_fragment, name="agents-fragment"),
    path("agents/<str:agent_id>/", views.agent_page, name="agent"),
    path("agents/<str:agent_id>/fragment", views.agent_fragment, name="agent-fragment"),
    path("agents/<str:agent_id>/prompt", views.agent_prompt_form, name="agent-prompt"),
    path("agents/<str:agent_id>/message", views.agent_message_form, name="agent-message"),
    path("agents/<str:agent_id>/keys", views.agent_keys_form, name="agent-keys"),
    path("agents/<str:agent_id>/stop", views.agent_stop_form, name="agent-stop"),
    path("agents/<str:agent_id>/start", views.agent_start_form, name="agent-start"),
    path("agents/<str:agent_id>/archive", views.agent_archive_form, name="agent-archive"),
]
