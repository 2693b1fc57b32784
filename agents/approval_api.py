"""REST routes of approvals and approval rules (docs/agents.md#approvals), scoped to the
caller: another user's approval or rule is 404, the same as an unknown id.

- ``GET /api/v1/approvals?status=pending&agent_id=`` — the caller's agents' approvals;
- ``GET /api/v1/approvals/{id}``;
- ``POST /api/v1/approvals/{id}/answer`` ``{"decision", "message"}``;
- ``GET /api/v1/approval-rules?agent_id=``, ``POST /api/v1/approval-rules``,
  ``DELETE /api/v1/approval-rules/{id}``.

An agent token (a supervising agent) lists and answers the approvals of the agents it may
message — every other agent of its owner — never its own (403 for an answer; its own are
left out of its list); its answer is recorded as its own (``answered_by_agent``). Rules are
a person's: an agent token may read them but not make or delete one (403).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from drf_spectacular.utils import OpenApiParameter, extend_schema
from pydantic import BaseModel, ConfigDict, Field
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from agents import approval_selectors, approvals, selectors
from agents.models import Agent, Approval, ApprovalRule
from agents.serializers import ApprovalData, ApprovalRuleData, approval_data, rule_data
from agents.tokens import agent_scope_forbid, calling_agent
from core.api import DispatchAPIView
from core.authentication import authenticated_user
from core.validation import BlankText, RawBlankText, Text, WireModel, parse_request

LIST_DEFAULT = 100
LIST_MAX = 500

if TYPE_CHECKING:
    Answer = str
    RuleAction = str
else:
    Answer = Literal[tuple(str(answer) for answer in approvals.ANSWERS)]
    RuleAction = Literal[tuple(ApprovalRule.Action.values)]


class AnswerApprovalBody(WireModel):
    """``POST /api/v1/approvals/{id}/answer``: ``{decision, message?}``; a ``message`` goes
    with ``deny`` only (``approvals.approval_answer`` refuses it with an allow)."""

    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"decision": {"not": {"const": "deny"}}}},
            "then": {"properties": {"message": {"pattern": r"^\s*$"}}},
        }
    )

    decision: Answer
    message: BlankText = Field(
        default="", max_length=approvals.MAX_MESSAGE, description="deny only: what the model is told"
    )


class ApprovalRuleCreateBody(WireModel):
    """``POST /api/v1/approval-rules``: ``{tool, pattern?, action, agent_id?}`` (policy
    order: docs/agents.md#approvals)."""

    # approvals.approval_rule_create: a tool's name has no spaces or control characters.
    tool: Text = Field(
        max_length=approvals.MAX_TOOL_NAME,
        description="a tool's exact name (Bash, Read) or *",
        json_schema_extra={"pattern": r"^[^\s\x00-\x1f\x7f]+$"},
    )
    pattern: RawBlankText = Field(
        default="",
        max_length=approvals.MAX_PATTERN,
        description="an fnmatch glob on the request's summary (the command, file, URL); empty: any",
    )
    action: RuleAction
    agent_id: Text | None = Field(default=None, description="null: every agent of yours")


class ApprovalList(BaseModel):
    """The caller's agents' approvals, newest first."""

    approvals: list[ApprovalData]


class ApprovalRuleList(BaseModel):
    """Approval rules, in policy order."""

    rules: list[ApprovalRuleData]


def _agent_filter(request: Request) -> Agent | None:
    agent_id = request.query_params.get("agent_id")
    return selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id) if agent_id else None


class ApprovalListView(DispatchAPIView):
    """``GET /api/v1/approvals`` → ``{"approvals": [...]}``, newest first, at most
    ``limit`` (1-500, default 100). ``status``: pending (default), allowed, denied, expired
    or ``all``; ``agent_id``: one agent's. Approvals whose time is up are expired first."""

    @extend_schema(
        operation_id="v1_approvals_list",
        parameters=[
            OpenApiParameter("status", str, enum=[*Approval.Status.values, "all"], description="default pending"),
            OpenApiParameter("agent_id", str, description="only this agent's approvals"),
            OpenApiParameter(
                "limit",
                {"type": "integer", "minimum": 1, "maximum": LIST_MAX},
                description=f"1-{LIST_MAX}, default {LIST_DEFAULT}",
            ),
        ],
        responses={200: ApprovalList},
    )
    def get(self, request: Request) -> Response:
        user = authenticated_user(request)
        wanted = request.query_params.get("status", "pending")
        limit = selectors.page_limit(request.query_params.get("limit"), default=LIST_DEFAULT, maximum=LIST_MAX)
        agent = _agent_filter(request)
        approvals.approvals_expire_due()
        rows = approval_selectors.approvals_for(
            user=user,
            status=None if wanted == "all" else wanted,
            agent=agent,
            exclude_agent=calling_agent(request),
        )
        listed = ApprovalList(approvals=[ApprovalData.from_row(row) for row in rows[:limit]])
        return Response(listed.model_dump(mode="json"))


class ApprovalDetailView(DispatchAPIView):
    """``GET /api/v1/approvals/{id}``: 404 for an unknown id or another user's."""

    @extend_schema(responses={200: ApprovalData})
    def get(self, request: Request, approval_id: str) -> Response:
        user = authenticated_user(request)
        if selectors.is_valid_id(approval_id):
            approvals.approvals_expire_due(approval_id=approval_id)
        return Response(approval_data(approval_selectors.approval_get_for(user=user, approval_id=approval_id)))


class ApprovalAnswerView(DispatchAPIView):
    """``POST /api/v1/approvals/{id}/answer`` ``{"decision": "allow_once" | "allow_always" |
    "deny", "message": ""}`` → 200 the answered approval. 400 for a bad body (a message
    with an allow), 404 unknown or another user's, 403 an agent answering its own approval,
    409 ``APPROVAL_ANSWERED`` naming who answered first (an expired one included)."""

    @extend_schema(request=AnswerApprovalBody, responses={200: ApprovalData})
    def post(self, request: Request, approval_id: str) -> Response:
        user = authenticated_user(request)
        body = parse_request(AnswerApprovalBody, request.data)
        caller = calling_agent(request)
        answered = approvals.approval_answer(
            approval_id=approval_id,
            decision=body.decision,
            message=body.message,
            user=user if caller is None else None,
            by_agent=caller,
        )
        return Response(approval_data(answered))


class ApprovalRuleListView(DispatchAPIView):
    """``GET /api/v1/approval-rules?agent_id=`` → ``{"rules": [...]}`` (with ``agent_id``:
    those that apply to it, its own and the user-wide ones) and ``POST`` a rule → 201.
    Policy order: docs/agents.md#approvals."""

    @extend_schema(
        operation_id="v1_approval_rules_list",
        parameters=[OpenApiParameter("agent_id", str, description="the rules that apply to this agent")],
        responses={200: ApprovalRuleList},
    )
    def get(self, request: Request) -> Response:
        rules = approval_selectors.approval_rules_for(user=authenticated_user(request), agent=_agent_filter(request))
        listed = ApprovalRuleList(rules=[ApprovalRuleData.from_row(rule) for rule in rules])
        return Response(listed.model_dump(mode="json"))

    @extend_schema(request=ApprovalRuleCreateBody, responses={201: ApprovalRuleData})
    def post(self, request: Request) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "make approval rules")
        body = parse_request(ApprovalRuleCreateBody, request.data)
        agent = selectors.agent_get_for(user=user, agent_id=body.agent_id) if body.agent_id else None
        rule = approvals.approval_rule_create(
            user=user, tool=body.tool, pattern=body.pattern, action=body.action, agent=agent
        )
        return Response(rule_data(rule), status=status.HTTP_201_CREATED)


class ApprovalRuleDetailView(DispatchAPIView):
    """``DELETE /api/v1/approval-rules/{id}`` → 204; 404 unknown or another user's; 403 with
    an agent token."""

    @extend_schema(responses={204: None})
    def delete(self, request: Request, rule_id: str) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "delete approval rules")
        approvals.approval_rule_delete(user=user, rule_id=rule_id)
        return Response(status=status.HTTP_204_NO_CONTENT)
