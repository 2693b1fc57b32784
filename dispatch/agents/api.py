"""REST routes for agents and runs (spec/agents.md §5), scoped to the caller.

Another user's agent or run is 404 on every route. Errors use the one error shape
(``dispatch.api.exception_handler``).
"""

from __future__ import annotations

from django.db import transaction
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from dispatch.agents import cli, selectors, services
from dispatch.agents.prompting import agent_prompt_for
from dispatch.agents.serializers import (
    AgentEventSerializer,
    AgentSerializer,
    RunSerializer,
    agent_data,
    run_data,
)
from dispatch.api import DispatchAPIView
from dispatch.authentication import authenticated_user
from dispatch.errors import InvalidRequest

# Launchable through the API in this slice: expert, and the CLI types cli.py runs (shell).
LAUNCHABLE_TYPES = (services.EXPERT, *cli.LAUNCHABLE_CLI_TYPES)


class AgentLaunchSerializer(serializers.Serializer):
    type = serializers.CharField(max_length=40)
    name = serializers.CharField(max_length=1000, trim_whitespace=False)
    prompt = serializers.CharField(required=False, allow_blank=True, default="", trim_whitespace=False)
    cwd = serializers.CharField(max_length=4096, trim_whitespace=False)
    location = serializers.CharField(required=False, allow_null=True, allow_blank=True, default=None)
    child = serializers.BooleanField(required=False, default=False)
    full_access = serializers.BooleanField(required=False, default=False)


def _query(request: Request, name: str) -> str | None:
    value = request.query_params.get(name)
    return value if value else None


class AgentListView(DispatchAPIView):
    """``GET /api/v1/agents`` (filters ``status``, ``type``; 100 per page; ``before`` cursor)
    and ``POST /api/v1/agents`` (launch)."""

    @extend_schema(
        operation_id="v1_agents_list",
        parameters=[
            OpenApiParameter("status", str, description="one agent status (archived agents are hidden otherwise)"),
            OpenApiParameter("type", str),
            OpenApiParameter("before", str, description="the `next` cursor of the previous page"),
        ],
        responses={
            200: inline_serializer(
                "AgentList", {"agents": AgentSerializer(many=True), "next": serializers.CharField(allow_null=True)}
            )
        },
    )
    def get(self, request: Request) -> Response:
        page = selectors.agents_for(
            user=authenticated_user(request),
            status=_query(request, "status"),
            type=_query(request, "type"),
            before=_query(request, "before"),
        )
        return Response({"agents": [agent_data(agent) for agent in page.items], "next": page.next})

    @extend_schema(request=AgentLaunchSerializer, responses={201: AgentSerializer})
    def post(self, request: Request) -> Response:
        incoming = AgentLaunchSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        body = incoming.validated_data
        if body["type"] not in LAUNCHABLE_TYPES:
            raise InvalidRequest(
                f"type '{body['type']}' cannot be launched yet; available types: {', '.join(LAUNCHABLE_TYPES)}",
                {"available_types": list(LAUNCHABLE_TYPES)},
            )
        if body["location"]:
            raise InvalidRequest("location: launching on a linked instance is not available yet; omit it")
        user = authenticated_user(request)
        if body["type"] in cli.LAUNCHABLE_CLI_TYPES:
            # Not in a transaction: the tmux session outlives the request either way.
            agent = cli.agent_launch(
                owner=user, type=body["type"], name=body["name"], prompt=body["prompt"], cwd=body["cwd"]
            )
            return Response(agent_data(agent), status=status.HTTP_201_CREATED)
        with transaction.atomic():
            agent = services.agent_create(
                owner=user, type=body["type"], name=body["name"], cwd=body["cwd"], full_access=body["full_access"]
            )
            if body["prompt"].strip():
                services.run_enqueue(agent=agent, instruction=body["prompt"])
        return Response(agent_data(agent), status=status.HTTP_201_CREATED)


class AgentDetailView(DispatchAPIView):
    """``GET /api/v1/agents/{id}`` (every field) and ``DELETE`` (archive; idempotent)."""

    @extend_schema(responses={200: AgentSerializer})
    def get(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        return Response(agent_data(agent))

    @extend_schema(responses={200: AgentSerializer})
    def delete(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        return Response(agent_data(services.agent_archive(agent=agent, note="archived by its user")))


class AgentStopView(DispatchAPIView):
    """``POST /api/v1/agents/{id}/stop``: stop a running CLI agent (409 otherwise)."""

    @extend_schema(request=None, responses={200: AgentSerializer})
    def post(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        if agent.type not in cli.LAUNCHABLE_CLI_TYPES:
            raise InvalidRequest(f"agent '{agent.pk}' of type '{agent.type}' cannot be stopped here")
        return Response(agent_data(cli.agent_stop(agent=agent)))


class AgentStartView(DispatchAPIView):
    """``POST /api/v1/agents/{id}/start``: start a stopped or failed CLI agent again (409 otherwise)."""

    @extend_schema(request=None, responses={200: AgentSerializer})
    def post(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        return Response(agent_data(cli.agent_start(agent=agent)))


class AgentPromptSerializer(serializers.Serializer):
    instruction = serializers.CharField(trim_whitespace=False)
    input = serializers.JSONField(required=False, allow_null=True, default=None)
    options = serializers.DictField(required=False, allow_null=True, default=None)


class AgentPromptView(DispatchAPIView):
    """``POST /api/v1/agents/{id}/prompt`` (spec/agents.md §4, §5): 202 ``{run_id}``."""

    @extend_schema(
        request=AgentPromptSerializer,
        responses={202: inline_serializer("PromptAccepted", {"run_id": serializers.CharField()})},
    )
    def post(self, request: Request, agent_id: str) -> Response:
        user = authenticated_user(request)
        selectors.agent_get_for(user=user, agent_id=agent_id)  # 404 before judging the body
        incoming = AgentPromptSerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        body = incoming.validated_data
        run = agent_prompt_for(
            user=user,
            agent_id=agent_id,
            instruction=body["instruction"],
            input=body["input"],
            options=body["options"],
        )
        return Response({"run_id": run.pk}, status=status.HTTP_202_ACCEPTED)


class AgentEventsView(DispatchAPIView):
    """``GET /api/v1/agents/{id}/events?limit=200&before=<cursor>``: newest first, max 500."""

    @extend_schema(
        operation_id="v1_agents_events_list",
        parameters=[OpenApiParameter("limit", int), OpenApiParameter("before", str)],
        responses={
            200: inline_serializer(
                "AgentEventList",
                {"events": AgentEventSerializer(many=True), "next": serializers.CharField(allow_null=True)},
            )
        },
    )
    def get(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        limit = selectors.page_limit(
            request.query_params.get("limit"),
            default=selectors.EVENTS_DEFAULT_LIMIT,
            maximum=selectors.EVENTS_MAX_LIMIT,
        )
        page = selectors.events_page(agent=agent, limit=limit, before=_query(request, "before"))
        return Response({"events": AgentEventSerializer(page.items, many=True).data, "next": page.next})


class AgentRunsView(DispatchAPIView):
    """``GET /api/v1/agents/{id}/runs``: newest first, 100 per page (``before`` cursor)."""

    @extend_schema(
        operation_id="v1_agents_runs_list",
        parameters=[OpenApiParameter("before", str)],
        responses={
            200: inline_serializer(
                "RunList", {"runs": RunSerializer(many=True), "next": serializers.CharField(allow_null=True)}
            )
        },
    )
    def get(self, request: Request, agent_id: str) -> Response:
        agent = selectors.agent_get_for(user=authenticated_user(request), agent_id=agent_id)
        page = selectors.runs_page(agent=agent, before=_query(request, "before"))
        return Response({"runs": RunSerializer(page.items, many=True).data, "next": page.next})


class RunDetailView(DispatchAPIView):
    """``GET /api/v1/runs/{id}``."""

    @extend_schema(responses={200: RunSerializer})
    def get(self, request: Request, run_id: str) -> Response:
        return Response(run_data(selectors.run_get_for(user=authenticated_user(request), run_id=run_id)))


class RunCancelView(DispatchAPIView):
    """``POST /api/v1/runs/{id}/cancel``: cancel a queued or running run (409 if finished)."""

    @extend_schema(request=None, responses={200: RunSerializer})
    def post(self, request: Request, run_id: str) -> Response:
        run = services.run_cancel(user=authenticated_user(request), run_id=run_id)
        return Response(run_data(run))
