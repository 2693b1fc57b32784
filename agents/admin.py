"""Admin for the agents' models; actions go through the agents' services."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from agents import approvals
from agents import services as agent_services
from agents.lifecycle import agent_archive_any, agent_stop_any
from agents.models import Agent, AgentEvent, AgentMessage, AgentToken, Approval, ApprovalRule, Run, SupervisorLease
from agents.tokens import agent_tokens_revoke
from core.admin import ReadOnlyAdmin
from core.errors import DispatchError


@admin.register(Agent)
class AgentAdmin(ReadOnlyAdmin):
    list_display = ["id", "name", "owner", "type", "status", "host", "latest_event_type", "latest_event_at"]
    list_filter = ["status", "type", "host", "full_access"]
    search_fields = ["id", "name", "owner__username", "cwd"]
    list_select_related = ["owner"]
    actions = ["stop", "archive"]

    @admin.action(description="Stop selected agents (CLI: interrupt, then the supervisor ends the session)")
    def stop(self, request: HttpRequest, queryset: QuerySet[Agent]) -> None:
        stopped, refused = 0, []
        for agent in queryset.select_related("owner"):
            try:
                agent_stop_any(agent=agent)
                stopped += 1
            except DispatchError as exc:
                refused.append(f"{agent.pk}: {exc.message}")
        self.message_user(request, f"Stopped {stopped} agent(s).", messages.SUCCESS)
        if refused:
            self.message_user(request, "Not stopped: " + "; ".join(refused), messages.WARNING)

    @admin.action(description="Archive selected agents (stops them; cancels their queued and running runs)")
    def archive(self, request: HttpRequest, queryset: QuerySet[Agent]) -> None:
        archived, refused = 0, []
        for agent in queryset.select_related("owner"):
            try:
                agent_archive_any(agent=agent)
                archived += 1
            except DispatchError as exc:
                refused.append(f"{agent.pk}: {exc.message}")
        self.message_user(request, f"Archived {archived} agent(s).", messages.SUCCESS)
        if refused:
            self.message_user(request, "Not archived: " + "; ".join(refused), messages.WARNING)


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = ["id", "agent", "status", "created_at", "started_at", "finished_at", "claimed_by"]
    list_filter = ["status"]
    search_fields = ["id", "agent__id", "agent__name", "agent__owner__username"]
    list_select_related = ["agent"]
    actions = ["cancel"]

    @admin.action(description="Cancel selected queued or running runs")
    def cancel(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        cancelled = 0
        for run in queryset.filter(status__in=[Run.Status.QUEUED, Run.Status.RUNNING]).select_related("agent__owner"):
            try:
                agent_services.run_cancel(user=run.agent.owner, run_id=run.pk)
                cancelled += 1
            except DispatchError:  # finished meanwhile
                pass
        self.message_user(request, f"Cancelled {cancelled} run(s).", messages.SUCCESS)


@admin.register(AgentEvent)
class AgentEventAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "agent", "type", "message", "run", "mirrored"]
    list_filter = ["type", "mirrored"]
    search_fields = ["agent__id", "agent__name", "message"]
    list_select_related = ["agent"]


@admin.register(AgentMessage)
class AgentMessageAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "recipient_agent",
        "sender_agent",
        "sender_user",
        "status",
        "short_content",
        "created_at",
        "delivered_at",
    ]
    list_filter = ["status", "created_at"]
    search_fields = ["=id", "recipient_agent__id", "recipient_agent__name", "sender_user__username", "content"]
    list_select_related = ["recipient_agent", "sender_agent", "sender_user"]

    @admin.display(description="content")
    def short_content(self, obj: AgentMessage) -> str:
        return obj.content if len(obj.content) <= 80 else obj.content[:79] + "…"


@admin.register(AgentToken)
class AgentTokenAdmin(ReadOnlyAdmin):
    """Agent tokens: prefix and times only (the digest stays hidden); revoke through the service."""

    list_display = ["prefix", "agent", "created_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter), "created_at"]
    search_fields = ["prefix", "agent__id", "agent__name", "agent__owner__username"]
    list_select_related = ["agent"]
    fields = ["agent", "prefix", "created_at", "revoked_at"]
    readonly_fields = ["agent", "prefix", "created_at", "revoked_at"]
    actions = ["revoke"]

    @admin.action(description="Revoke every live token of the selected tokens' agents")
    def revoke(self, request: HttpRequest, queryset: QuerySet[AgentToken]) -> None:
        revoked = 0
        for agent in Agent.objects.filter(pk__in=queryset.values("agent_id")):
            revoked += agent_tokens_revoke(agent=agent)
        self.message_user(request, f"Revoked {revoked} token(s).", messages.SUCCESS)


@admin.register(SupervisorLease)
class SupervisorLeaseAdmin(ReadOnlyAdmin):
    list_display = [field.name for field in SupervisorLease._meta.fields]


@admin.register(Approval)
class ApprovalAdmin(ReadOnlyAdmin):
    """Every permission request and its answer (docs/agents.md#approvals): a record, never
    edited or deleted here; the actions answer through ``agents.approvals``."""

    list_display = ["id", "agent", "tool_name", "short_summary", "status", "decision", "answered_by", "asked_at"]
    list_filter = ["status", "decision", "hook_event", "asked_at"]
    search_fields = ["=id", "agent__id", "agent__name", "agent__owner__username", "tool_name", "tool_summary"]
    list_select_related = ["agent"]
    actions = ["deny", "expire_overdue"]

    def has_delete_permission(self, request: HttpRequest, obj: Approval | None = None) -> bool:
        return False

    @admin.display(description="request")
    def short_summary(self, obj: Approval) -> str:
        return obj.tool_summary if len(obj.tool_summary) <= 80 else obj.tool_summary[:79] + "…"

    @admin.action(description="Deny the selected pending approvals of your own agents (recorded as yours)")
    def deny(self, request: HttpRequest, queryset: QuerySet[Approval]) -> None:
        denied, refused = 0, []
        for approval in queryset.filter(status=Approval.Status.PENDING):
            try:
                approvals.approval_answer(approval_id=approval.pk, decision="deny", user=request.user)  # type: ignore[arg-type]
                denied += 1
            except DispatchError as exc:
                refused.append(f"{approval.pk}: {exc.message}")
        self.message_user(request, f"Denied {denied} approval(s).", messages.SUCCESS)
        if refused:
            self.message_user(request, "Not denied: " + "; ".join(refused), messages.WARNING)

    @admin.action(description="Expire overdue pending approvals now (each gets its agent's default)")
    def expire_overdue(self, request: HttpRequest, queryset: QuerySet[Approval]) -> None:
        expired = approvals.approvals_expire_due()
        self.message_user(request, f"Expired {len(expired)} approval(s).", messages.SUCCESS)


@admin.register(ApprovalRule)
class ApprovalRuleAdmin(ReadOnlyAdmin):
    """Policy rules (docs/agents.md#approvals); made by their owners (REST, pages, "Always
    allow this rule"), deleted here through ``approvals.approval_rule_delete``."""

    list_display = ["id", "owner", "agent", "tool", "pattern", "action", "created_at", "created_by_approval"]
    list_filter = ["action", "created_at"]
    search_fields = ["owner__username", "agent__id", "agent__name", "tool", "pattern"]
    list_select_related = ["owner", "agent"]

    def delete_model(self, request: HttpRequest, obj: ApprovalRule) -> None:
        approvals.approval_rule_delete(user=obj.owner, rule_id=obj.pk)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ApprovalRule]) -> None:
        for rule in queryset.select_related("owner"):
            approvals.approval_rule_delete(user=rule.owner, rule_id=rule.pk)
