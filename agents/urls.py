"""``/api/v1`` routes of agents and runs (docs/agents.md#the-rest-api); wired in ``dispatch/urls.py``."""

from __future__ import annotations

from django.urls import path

from agents import api, approval_api, hook_api, stream

api_urlpatterns = [
    path("agents", api.AgentListView.as_view(), name="api-agents"),
    path("agent-types", api.AgentTypesView.as_view(), name="api-agent-types"),
    path("messages/<str:message_id>", api.MessageDetailView.as_view(), name="api-message"),
    path("agents/<str:agent_id>", api.AgentDetailView.as_view(), name="api-agent"),
    path("agents/<str:agent_id>/stop", api.AgentStopView.as_view(), name="api-agent-stop"),
    path("agents/<str:agent_id>/start", api.AgentStartView.as_view(), name="api-agent-start"),
    path("agents/<str:agent_id>/prompt", api.AgentPromptView.as_view(), name="api-agent-prompt"),
    path("agents/<str:agent_id>/events", api.AgentEventsView.as_view(), name="api-agent-events"),
    path("agents/<str:agent_id>/messages", api.AgentMessagesView.as_view(), name="api-agent-messages"),
    path("agents/<str:agent_id>/hooks", hook_api.AgentHookView.as_view(), name="api-agent-hooks"),
    path(
        "agents/<str:agent_id>/hooks/approvals/<str:approval_id>",
        hook_api.AgentHookApprovalView.as_view(),
        name="api-agent-hook-approval",
    ),
    path("agents/<str:agent_id>/keys", api.AgentKeysView.as_view(), name="api-agent-keys"),
    path("agents/<str:agent_id>/runs", api.AgentRunsView.as_view(), name="api-agent-runs"),
    path("runs/<str:run_id>", api.RunDetailView.as_view(), name="api-run"),
    path("runs/<str:run_id>/cancel", api.RunCancelView.as_view(), name="api-run-cancel"),
    path("events", stream.events_stream, name="api-events"),
    path("approvals", approval_api.ApprovalListView.as_view(), name="api-approvals"),
    path("approvals/<str:approval_id>", approval_api.ApprovalDetailView.as_view(), name="api-approval"),
    path("approvals/<str:approval_id>/answer", approval_api.ApprovalAnswerView.as_view(), name="api-approval-answer"),
    path("approval-rules", approval_api.ApprovalRuleListView.as_view(), name="api-approval-rules"),
    path("approval-rules/<str:rule_id>", approval_api.ApprovalRuleDetailView.as_view(), name="api-approval-rule"),
]
