"""REST routes for agents and runs (docs/agents.md#the-rest-api), scoped to the caller.

Another user's agent or run is 404 on every route. Errors use the one error shape
(``core.api.exception_handler``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from asgiref.sync import async_to_sync
from drf_spectacular.utils import OpenApiParameter, extend_schema
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from agents import keys as agent_keys
from agents import launching, lifecycle, messages, selectors, services
from agents.models import Agent
from agents.protocol import AgentPromptBody
from agents.serializers import (
    AgentData,
    AgentEventData,
    AgentMessageData,
    RunData,
    agent_data,
    event_data,
    message_data,
    run_data,
)
from agents.tokens import agent_scope_forbid, agent_scope_manage, calling_agent
from core.api import DispatchAPIView
from core.authentication import authenticated_user
from core.errors import InvalidRequest, NotFound
from core.validation import BlankText, RawBlankText, RawText, WireModel, parse_request
from peers.remote_launch import launch_at_location, location_resolve

NEXT_PAGE = "the cursor of the next page (its before), null on the last page"


class AgentLaunchBody(WireModel):
    """``POST /api/v1/agents``: ``{name, type?, prompt?, cwd?, location?, child?,
    full_access?, trust_folder?}``. Text fields take JSON strings only, flags JSON
    ``true``/``false`` only (not ``"yes"`` or ``1``: a flag as strong as ``full_access``
    must be meant); ``type`` and ``location`` are trimmed. The service checks the rest
    (the type's availability, ``name`` at most 100 characters, ``cwd``)."""

    # agents.api.AgentListView.post: trust_folder is for a launch here, not with a location.
    model_config = ConfigDict(
        json_schema_extra={
            "not": {
                "properties": {"trust_folder": {"const": True}, "location": {"type": "string", "pattern": r"\S"}},
                "required": ["trust_folder", "location"],
            }
        }
    )

    type: BlankText = Field(
        default="",
        max_length=40,
        description="an agent type (GET /api/v1/agent-types); absent: the default type here (expert with a model "
        "endpoint, else the first installed LLM CLI; with neither it is required), or with location the "
        "linked instance's",
    )
    name: RawText = Field(max_length=1000)
    prompt: RawBlankText = ""
    cwd: RawBlankText = Field(
        default="",
        max_length=4096,
        description="absolute directory (a leading ~ is expanded); default: the launching agent's cwd, else "
        "DISPATCH_DEFAULT_CWD; required with location",
    )
    location: BlankText | None = Field(
        default=None, description="a linked instance (its label or id): launch there, its shadow here"
    )
    child: StrictBool = False
    full_access: StrictBool = False
    trust_folder: StrictBool = Field(
        default=False,
        description="claude and codex types launch only in a trusted folder (else 400 FOLDER_NOT_TRUSTED): true "
        "trusts cwd for your CLI agents from now on and launches (a person's decision: refused with an agent's "
        "token, 403). Not with location (trust the folder on that instance). docs/agents.md#folder-trust",
    )


class AgentList(BaseModel):
    """A page of agents, newest first."""

    agents: list[AgentData]
    next: str | None = Field(description=NEXT_PAGE)


MESSAGE_ID = re.compile(r"[0-9]{1,19}")


def _query(request: Request, name: str) -> str | None:
    value = request.query_params.get(name)
    return value if value else None


def _limit(maximum: int) -> OpenApiParameter:
    """The ``limit`` query parameter of a page, as ``selectors.page_limit`` reads it (1 to
    ``maximum``)."""
    return OpenApiParameter("limit", {"type": "integer", "minimum": 1, "maximum": maximum})


class AgentListView(DispatchAPIView):
    """``GET /api/v1/agents`` (filters ``status``, ``type``; 100 per page; ``before`` cursor)
    and ``POST /api/v1/agents`` (launch)."""

    @extend_schema(
        operation_id="v1_agents_list",
        parameters=[
            OpenApiParameter(
                "status",
                str,
                enum=Agent.Status.values,
                description="one agent status (archived agents are hidden otherwise)",
            ),
            OpenApiParameter("type", str, pattern=r"^[A-Za-z0-9_-]{1,64}$"),  # selectors.is_valid_id
            OpenApiParameter("before", str, description="the `next` cursor of the previous page"),
        ],
        responses={200: AgentList},
    )
    def get(self, request: Request) -> Response:
        page = selectors.agents_for(
            user=authenticated_user(request),
            status=_query(request, "status"),
            type=_query(request, "type"),
            before=_query(request, "before"),
        )
        listed = AgentList(agents=[AgentData.from_row(agent) for agent in page.items], next=page.next)
        return Response(listed.model_dump(mode="json"))

    @extend_schema(request=AgentLaunchBody, responses={201: AgentData})
    def post(self, request: Request) -> Response:
        """Launch any configured type (``lifecycle.agent_launch_any``; an unavailable type is
        refused with the list of available ones); without ``type``, the default type
        (``launching.launch_type_resolve``: 400 listing the available types when there is
        none). With an agent token the caller is ``launched_by`` and, with ``child: true``,
        the parent. A claude/codex launch in a folder nobody trusted is 400
        ``FOLDER_NOT_TRUSTED`` unless a person sends ``trust_folder: true``
        (docs/agents.md#folder-trust)."""
        body = parse_request(AgentLaunchBody, request.data)
        launcher = calling_agent(request)
        if body.child and launcher is None:
            raise InvalidRequest("child: only an agent (calling with its own token) can launch a child agent")
        if body.location:  # on a linked instance: a shadow here (docs/peers.md#using-a-link)
            if body.trust_folder:
                raise InvalidRequest(
                    "trust_folder applies to a launch here: a folder on a linked instance is trusted by a person "
                    "there (a launch there with trust_folder, or its DISPATCH_TRUSTED_ROOTS)"
                )
            user = authenticated_user(request)
            location_resolve(user=user, location=body.location)  # a bad one is 400 before any wait
            shadow = async_to_sync(launch_at_location)(
                user=user, caller_agent=launcher, location=body.location, fields=body.model_dump()
            )
            return Response(agent_data(shadow), status=status.HTTP_201_CREATED)
        agent = lifecycle.agent_launch_any(
            owner=authenticated_user(request),
            type=launching.launch_type_resolve(body.type),
            name=body.name,
            prompt=body.prompt,
            cwd=body.cwd or None,
            launched_by=launcher,
            child=body.child,
            full_access=body.full_access,
            trust_folder=body.trust_folder,
        )
        return Response(agent_data(agent), status=status.HTTP_201_CREATED)


class AgentTypeData(BaseModel):
    """One agent type (docs/agents.md#agent-types)."""

    type: str
    kind: Literal["expert", "llm", "shell"]
    available: bool = Field(description="whether an agent of this type works here now")
    reason: str = Field(description='why it is not available ("" when it is)')


class AgentTypeList(BaseModel):
    """Every agent type and the default one."""

    types: list[AgentTypeData]
    default: str | None = Field(description="the type a launch without one gets; null: type is required")


class AgentTypesView(DispatchAPIView):
    """``GET /api/v1/agent-types``: ``{"types": [{type, kind, available, reason}], "default"}``.
    ``expert`` is unavailable without a model endpoint (``DISPATCH_LLM_BASE_URL``), a CLI
    type when its program is not on PATH (it is then refused at launch); ``default`` is the
    type a launch without one gets, ``null`` when a launch must name its type."""

    @extend_schema(
        operation_id="v1_agent_types_list",
        responses={200: AgentTypeList},
    )
    def get(self, request: Request) -> Response:
        authenticated_user(request)
        listed = AgentTypeList.model_validate(
            {"types": launching.agent_types_data(), "default": launching.default_launch_type()}
        )
        return Response(listed.model_dump(mode="json"))


class AgentDetailView(DispatchAPIView):
    """``GET /api/v1/agents/{id}`` (every field) and ``DELETE`` (archive; idempotent)."""

    @extend_schema(responses={200: AgentData})
    def get(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        return Response(agent_data(agent))

    @extend_schema(responses={200: AgentData})
    def delete(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        agent_scope_manage(calling_agent(request), agent)
        return Response(agent_data(lifecycle.agent_archive_any(agent=agent)))


class AgentStopView(DispatchAPIView):
    """``POST /api/v1/agents/{id}/stop``: a CLI agent goes ``stopping`` (the supervisor
    finishes), an expert agent ``stopped`` with its runs cancelled; 409 when not running."""

    @extend_schema(request=None, responses={200: AgentData})
    def post(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        agent_scope_manage(calling_agent(request), agent)
        return Response(agent_data(lifecycle.agent_stop_any(agent=agent)))


class AgentStartView(DispatchAPIView):
    """``POST /api/v1/agents/{id}/start``: start a stopped or failed agent again (409 otherwise)."""

    @extend_schema(request=None, responses={200: AgentData})
    def post(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        agent_scope_manage(calling_agent(request), agent)
        return Response(agent_data(lifecycle.agent_start_any(agent=agent)))


class PromptAccepted(BaseModel):
    """A prompt taken: the run an expert agent got, or the message a CLI agent got (the
    other field absent)."""

    run_id: str | None = Field(default=None, description="expert agents")
    message_id: int | None = Field(default=None, description="CLI agents")


class AgentPromptView(DispatchAPIView):
    """``POST /api/v1/agents/{id}/prompt`` (docs/agents.md#prompts-and-runs): 202 ``{run_id}`` for an
    expert agent, 202 ``{message_id}`` for a CLI agent (its prompt is a message)."""

    @extend_schema(
        request=AgentPromptBody,
        responses={202: PromptAccepted},
    )
    def post(self, request: Request, agent_id: str) -> Response:
        user = authenticated_user(request)
        selectors.agent_get_for(user=user, agent_id=agent_id)  # 404 before judging the body
        body = parse_request(AgentPromptBody, request.data)
        accepted = lifecycle.agent_prompt_any(
            user=user,
            agent_id=agent_id,
            instruction=body.instruction,
            input=body.input,
            options=body.options,
            sender_agent=calling_agent(request),
        )
        if accepted.message_id is not None:
            answer = PromptAccepted(message_id=accepted.message_id)
        else:
            answer = PromptAccepted(run_id=accepted.run_id)
        return Response(answer.model_dump(mode="json", exclude_unset=True), status=status.HTTP_202_ACCEPTED)


class MessageSendBody(WireModel):
    """``POST /api/v1/agents/{id}/messages``: ``{content}``, the text as it is typed or
    prompted (not trimmed)."""

    content: RawText = Field(max_length=messages.MAX_MESSAGE_LENGTH)


class AgentMessageList(BaseModel):
    """A page of an agent's messages, newest first."""

    messages: list[AgentMessageData]
    next: str | None = Field(description=NEXT_PAGE)


class AgentMessagesView(DispatchAPIView):
    """``GET /api/v1/agents/{id}/messages?limit=50&before=<cursor>`` (newest first, max 200;
    messages the agent received or sent) and ``POST`` ``{content}`` → 201 with the message."""

    @extend_schema(
        operation_id="v1_agents_messages_list",
        parameters=[_limit(selectors.MESSAGES_MAX_LIMIT), OpenApiParameter("before", str)],
        responses={200: AgentMessageList},
    )
    def get(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        limit = selectors.page_limit(
            request.query_params.get("limit"),
            default=selectors.MESSAGES_DEFAULT_LIMIT,
            maximum=selectors.MESSAGES_MAX_LIMIT,
        )
        page = selectors.messages_page(agent=agent, limit=limit, before=_query(request, "before"))
        listed = AgentMessageList(messages=[AgentMessageData.from_row(row) for row in page.items], next=page.next)
        return Response(listed.model_dump(mode="json"))

    @extend_schema(
        operation_id="v1_agents_messages_create",
        request=MessageSendBody,
        responses={201: AgentMessageData},
    )
    def post(self, request: Request, agent_id: str) -> Response:
        """A CLI agent's message is ``queued`` until the supervisor pastes it; an expert
        agent's queues a run and is ``delivered``. 409 when the agent is not running. A
        shadow agent's goes to its peer through the outbox (``queued`` until the peer
        answers; docs/peers.md#the-outbox)."""
        user = authenticated_user(request)
        agent = selectors.agent_get_for(user=user, agent_id=agent_id)
        body = parse_request(MessageSendBody, request.data)
        message = lifecycle.agent_message_send(
            user=user, recipient=agent, content=body.content, sender_agent=calling_agent(request)
        )
        return Response(message_data(message), status=status.HTTP_201_CREATED)


class MessageDetailView(DispatchAPIView):
    """``GET /api/v1/messages/{id}``: one of the caller's messages (404 for anyone else's)."""

    @extend_schema(operation_id="v1_messages_retrieve", responses={200: AgentMessageData})
    def get(self, request: Request, message_id: str) -> Response:
        if MESSAGE_ID.fullmatch(message_id) is None:  # "abc", "-1", " 1", "1e3": names no message
            raise NotFound("no such message")
        message = messages.message_get(user=authenticated_user(request), message_id=message_id)
        return Response(message_data(message))


class AgentEventList(BaseModel):
    """A page of an agent's events, newest first."""

    events: list[AgentEventData]
    next: str | None = Field(description=NEXT_PAGE)


class AgentEventsView(DispatchAPIView):
    """``GET /api/v1/agents/{id}/events?limit=200&before=<cursor>``: newest first, max 500."""

    @extend_schema(
        operation_id="v1_agents_events_list",
        parameters=[_limit(selectors.EVENTS_MAX_LIMIT), OpenApiParameter("before", str)],
        responses={200: AgentEventList},
    )
    def get(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        limit = selectors.page_limit(
            request.query_params.get("limit"),
            default=selectors.EVENTS_DEFAULT_LIMIT,
            maximum=selectors.EVENTS_MAX_LIMIT,
        )
        page = selectors.events_page(agent=agent, limit=limit, before=_query(request, "before"))
        listed = AgentEventList(events=[AgentEventData.from_row(event) for event in page.items], next=page.next)
        return Response(listed.model_dump(mode="json"))


class RunList(BaseModel):
    """A page of an agent's runs, newest first."""

    runs: list[RunData]
    next: str | None = Field(description=NEXT_PAGE)


class AgentRunsView(DispatchAPIView):
    """``GET /api/v1/agents/{id}/runs``: newest first, 100 per page (``before`` cursor)."""

    @extend_schema(
        operation_id="v1_agents_runs_list",
        parameters=[OpenApiParameter("before", str)],
        responses={200: RunList},
    )
    def get(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        page = selectors.runs_page(agent=agent, before=_query(request, "before"))
        listed = RunList(runs=[RunData.from_row(run) for run in page.items], next=page.next)
        return Response(listed.model_dump(mode="json"))


if TYPE_CHECKING:
    KeyName = str
else:
    KeyName = Literal[tuple(agent_keys.KEYS_ALLOWED)]


class AgentKeysBody(BaseModel):
    """``POST /api/v1/agents/{id}/keys``: ``{"keys": [name, …]}``. Documents the body only:
    ``keys.keys_validate`` checks it, its refusal naming the allowed keys
    (docs/agents.md#keys)."""

    keys: list[KeyName] = Field(min_length=1, max_length=agent_keys.KEYS_MAX, description="key names, in order")


class AgentKeysView(DispatchAPIView):
    """``POST /api/v1/agents/{id}/keys`` ``{"keys": ["Down", "Enter"]}``: the owner presses
    keys in a CLI agent's pane (``keys.agent_keys_send``; docs/agents.md#keys). 200 with
    the timeline event recorded; 400 naming the allowed keys for any other key, or for a
    shadow or expert agent; 403 with an agent token (a person's action); 409 when the agent
    is not running here or its pane is dead."""

    @extend_schema(request=AgentKeysBody, responses={200: AgentEventData})
    def post(self, request: Request, agent_id: str) -> Response:
        user = authenticated_user(request)
        agent = selectors.agent_get_for(user=user, agent_id=agent_id)
        agent_scope_forbid(calling_agent(request), "press keys in a pane")
        keys = request.data.get("keys") if isinstance(request.data, dict) else None
        event = agent_keys.agent_keys_send(user=user, agent=agent, keys=keys)
        return Response(event_data(event))


class RunDetailView(DispatchAPIView):
    """``GET /api/v1/runs/{id}``."""

    @extend_schema(responses={200: RunData})
    def get(self, request: Request, run_id: str) -> Response:
        return Response(run_data(selectors.run_get_for(user=authenticated_user(request), run_id=run_id)))


class RunCancelView(DispatchAPIView):
    """``POST /api/v1/runs/{id}/cancel``: cancel a queued or running run (409 if finished)."""

    @extend_schema(request=None, responses={200: RunData})
    def post(self, request: Request, run_id: str) -> Response:
        user = authenticated_user(request)
        agent_scope_manage(calling_agent(request), selectors.run_get_for(user=user, run_id=run_id).agent)
        run = services.run_cancel(user=user, run_id=run_id)
        return Response(run_data(run))
