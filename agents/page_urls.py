"""Page routes of the agents (``/`` and ``/agents/<id>/``) and of their approvals (``/approvals/``)."""

from __future__ import annotations

from django.urls import path

from agents import approval_pages, views

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
    path("approvals/", approval_pages.approvals_page, name="approvals"),
    path("approvals/fragment", approval_pages.approvals_fragment, name="approvals-fragment"),
    path("approvals/rules", approval_pages.approval_rule_add_form, name="approval-rule-add"),
    path("approvals/rules/<int:rule_id>/delete", approval_pages.approval_rule_delete_form, name="approval-rule-delete"),
    path("approvals/<str:approval_id>/", approval_pages.approval_page, name="approval"),
    path("approvals/<str:approval_id>/answer", approval_pages.approval_answer_form, name="approval-answer"),
]
