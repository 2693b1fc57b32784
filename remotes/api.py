"""REST routes of the remotes app (``/api/v1/remotes``)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest
from django.views.decorators.http import require_POST
from drf_spectacular.utils import extend_schema
from pydantic import BaseModel, Field, JsonValue
from rest_framework.request import Request
from rest_framework.response import Response

from core.api import DispatchAPIView
from core.authentication import authenticated_user
from core.http import json_api, json_object
from core.openapi import Operation, documented
from core.validation import UtcDateTime
from remotes.calls import call_from_body
from remotes.protocol import RemoteCallAnswer, RemoteCallBody
from remotes.selectors import remotes_for


class RemoteFunction(BaseModel):
    """One function a remote serves, as it declared it (``remotes.protocol.FunctionSpec``)."""

    name: str
    description: str
    parameters: dict[str, JsonValue] = Field(description="a JSON Schema object: the function's arguments")


class Remote(BaseModel):
    """A connected remote, read from its row (``remotes.models.Remote``)."""

    remotename: str = Field(validation_alias="name")
    functions: list[RemoteFunction] = Field(validation_alias="tools")
    ws_session: str = Field(validation_alias="ws_session_id", description="the /ws session serving it")
    connected_at: UtcDateTime


class RemoteList(BaseModel):
    remotes: list[Remote]


class RemoteListView(DispatchAPIView):
    """``GET /api/v1/remotes`` → ``{"remotes": [...]}``: the caller's connected remotes."""

    @extend_schema(responses={200: RemoteList})
    def get(self, request: Request) -> Response:
        remotes = remotes_for(user=authenticated_user(request))
        shown = [Remote.model_validate(remote, from_attributes=True) for remote in remotes]
        return Response(RemoteList(remotes=shown).model_dump(mode="json"))


@documented(
    Operation("post", "Call a function of one of your connected remotes", "remotes", RemoteCallBody, RemoteCallAnswer)
)
@require_POST
@json_api
async def remote_call_api(request: HttpRequest, user: User, remotename: str) -> dict[str, Any]:
    """``POST /api/v1/remotes/{remotename}/call`` with ``{function, args, timeout?}``.

    An async view, not DRF: the wait happens on the channel layer, never on the shared
    sync thread. Bearer token or session (+ CSRF). 200 ``{"result": …}``; errors in the
    one error shape (404 not connected, 400 bad arguments, 502 disconnected or failed,
    503 busy, 504 timeout).
    """
    body = json_object(request)
    return {"result": await call_from_body(user=user, body={**body, "remotename": remotename})}
