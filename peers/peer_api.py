"""The peer API this instance serves to its linked peers (docs/peers.md#the-peer-api), except events.

| route | capability | answer |
|---|---|---|
| ``POST /api/v1/peers/launch`` | ``allow_launch`` | 201 ``{agent_id, name, status}`` |
| ``POST /api/v1/peers/messages`` | ``allow_message`` | 200 ``{"delivered": true, "message_id"}`` |
| ``POST /api/v1/peers/messages/batch`` | ``allow_message`` | 200 ``{"receipts": [{idempotency_key, status, body}]}`` |
| ``GET /api/v1/peers/repos`` | — | 200 ``{"roots": [...]}`` |
| ``POST /api/v1/peers/agents/{agent_id}/stop`` / ``archive`` | ``allow_launch`` | 200 ``{agent_id, name, status}`` |
| ``POST /api/v1/peers/unlink`` | — | 200 ``{"unlinked": true}`` |
| ``GET /api/v1/peers/approvals`` | ``allow_message`` | 200 ``{"approvals": [...]}`` (docs/peers.md#approvals) |
| ``POST /api/v1/peers/approvals/{id}/answer`` | ``allow_message`` | 200 the answered approval ``{id, status, …}`` |

Every answer, errors included, carries this instance's ``Dispatch-Peer-Features`` header
(``peers.auth.announce_features``); ``messages.batch`` there announces the batch route.
Every request is authenticated as a peer (``peers.auth``: bearer token + RFC 9421
signature, docs/peers.md#authentication); then the route's own capability flag is checked (403
``CAPABILITY_NOT_GRANTED``); every POST needs an ``Idempotency-Key`` (400 without) and is
answered through a receipt (``peers.receipts``): a repeated key gets the first answer,
another body under it 422. Errors: ``{"error": {code, message, details}}``; an
unexpected failure delivering a message is 503 ``TEMPORARILY_UNAVAILABLE`` (the sender
retries), any other route lets it be a 500.

The bodies are the models of ``peers.protocol``, which also describe them in the OpenAPI
schema (``core.openapi.documented``), validated after the receipt (a reused key answers 422
whatever the body): ``LaunchBody`` here, ``MessageBody`` by
``services.peer_message_deliver``, which opens the receipt in the message's transaction;
stop, archive and unlink ignore their body (``EmptyBody``).

The views are sync (short database work and at most a tmux command, like the REST API);
nothing here waits on the network.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import URLPattern, URLResolver, path
from django.views.decorators.csrf import csrf_exempt
from pydantic import BaseModel

from core.errors import DispatchError
from core.http import json_object
from core.openapi import Operation, documented
from core.validation import parse_plain
from peers.auth import (
    PEER_SECURITY,
    PeerAuthError,
    announce_features,
    method_refusal,
    peer_authenticate_sync,
    peer_error_response,
)
from peers.models import Peer
from peers.protocol import (
    PEER_INSTANCE_ID,
    ApprovalAnswerBody,
    EmptyBody,
    LaunchBody,
    MessageAnswer,
    MessageBatchAnswer,
    MessageBatchBody,
    MessageBody,
    PeerAgentAnswer,
    PeerApprovalAnswer,
    PeerApprovalList,
    ReposAnswer,
    UnlinkAnswer,
)
from peers.services import approvals as approval_services
from peers.services import incoming as services
from peers.services import receipts
from peers.services.pairing import peer_mark_unlinked_by_peer
from peers.services.receipts import Answer

logger = logging.getLogger(__name__)

PeerView = Callable[..., Answer]


def _error(exc: DispatchError) -> JsonResponse:
    return JsonResponse(exc.as_dict(), status=exc.http_status)


def peer_route(*, method: str, capability: str | None = None) -> Callable[[PeerView], Callable[..., HttpResponse]]:
    """Wrap ``view(request, peer, **kwargs) -> Answer`` as a peer API route.

    Order of checks: method (405), peer authentication (401/403 from ``peers.auth``),
    ``capability`` (an ``allow_*`` flag; 403 ``CAPABILITY_NOT_GRANTED``), then the view.
    ``DispatchError`` renders as ``{"error": …}`` with its status.
    """

    def decorate(view: PeerView) -> Callable[..., HttpResponse]:
        @wraps(view)
        def wrapper(request: HttpRequest, **kwargs: Any) -> HttpResponse:
            if request.method != method:
                return method_refusal(method)
            try:
                peer = peer_authenticate_sync(request)
                if capability is not None:
                    services.capability_require(peer=peer, flag=capability)
                answer = view(request, peer, **kwargs)
            except PeerAuthError as exc:
                return peer_error_response(exc)
            except DispatchError as exc:
                return _error(exc)
            return JsonResponse(answer.body, status=answer.status)

        return announce_features(csrf_exempt(login_not_required(wrapper)))

    return decorate


def _peer_operation(
    method: str, summary: str, body: type[BaseModel] | None, answer: type[BaseModel], status: int = 200
) -> Operation:
    """An operation of the peer API in the schema: its token and signature (``PEER_SECURITY``)."""
    return Operation(method, summary, "peer API", body, answer, status=status, security=PEER_SECURITY)


@documented(
    _peer_operation("post", "Launch an agent here for the peer (allow_launch)", LaunchBody, PeerAgentAnswer, status=201)
)
@peer_route(method="POST", capability="allow_launch")
def launch(request: HttpRequest, peer: Peer) -> Answer:
    """``POST /api/v1/peers/launch`` (docs/peers.md#launch): ``services.peer_launch_here`` once per key.

    201 ``{agent_id, name, status}``; a repeated key returns the first answer. 400 for a
    bad body or a ``cwd`` outside ``DISPATCH_REPO_ROOTS`` (or none configured); 403 for
    ``full_access`` without ``allow_full_access``; 409 while a request under the key is
    still being processed; 422 for another body under the key.
    """
    key = receipts.idempotency_key_of(request)
    body = json_object(request)

    def act() -> Answer:
        # After the receipt, where the route has always judged the body (a reused key: 422).
        launch = parse_plain(LaunchBody, body, context={PEER_INSTANCE_ID: peer.instance_id})
        return Answer(status=201, body=services.launch_answer(services.peer_launch_here(peer=peer, launch=launch)))

    return receipts.run_once(peer=peer, key=key, route="launch", body=body, act=act)


@documented(
    _peer_operation(
        "post",
        "Deliver a message to one of our agents (allow_message); a repeated key answers duplicate",
        MessageBody,
        MessageAnswer,
    )
)
@peer_route(method="POST", capability="allow_message")
def messages(request: HttpRequest, peer: Peer) -> Answer:
    """``POST /api/v1/peers/messages`` (docs/peers.md#messages): ``services.peer_message_deliver``.

    200 ``{"delivered": true, "message_id"}``; a repeated key 200 ``{"delivered": true,
    "duplicate": true}``; 409 when the agent is gone or not running (permanent; the
    receipt is removed); 422 for another body under the key; 503 for any other failure
    (retry).
    """
    key = receipts.idempotency_key_of(request)
    body = json_object(request)
    try:
        return services.peer_message_deliver(peer=peer, idempotency_key=key, body=body)
    except DispatchError:
        raise
    except Exception:
        logger.exception("delivering a message from peer %s failed", peer.label)
        return services.message_unavailable_answer()


@documented(
    _peer_operation(
        "post",
        "Deliver several messages in order, a receipt each (allow_message; feature messages.batch)",
        MessageBatchBody,
        MessageBatchAnswer,
    )
)
@peer_route(method="POST", capability="allow_message")
def messages_batch(request: HttpRequest, peer: Peer) -> Answer:
    """``POST /api/v1/peers/messages/batch`` (feature ``messages.batch``, announced in
    ``Dispatch-Peer-Features``): ``{"messages": [{idempotency_key, to_agent_id, content,
    from}, …]}`` — up to ``BATCH_MAX_MESSAGES`` messages in the sender's outbox order, each
    handled as its own ``POST /api/v1/peers/messages`` under its own key
    (``services.peer_messages_deliver``).

    200 ``{"receipts": [{idempotency_key, status, body}, …]}``: one per message, in order,
    ending at the first 503 (the rest were not attempted). The request's own
    ``Idempotency-Key`` is required and signed like every peer POST; a replayed batch is
    answered from the messages' receipts (each ``{"delivered": true, "duplicate": true}``),
    never delivered again. 400 for a malformed envelope (nothing delivered); 503 when the
    batch as a whole failed.
    """
    receipts.idempotency_key_of(request)
    batch = parse_plain(MessageBatchBody, json_object(request))
    try:
        answers = services.peer_messages_deliver(peer=peer, batch=batch)
    except DispatchError:
        raise
    except Exception:
        logger.exception("delivering a batch of messages from peer %s failed", peer.label)
        return services.message_unavailable_answer()
    keys = [entry["idempotency_key"] for entry in batch.messages]
    return Answer(
        status=200,
        body={
            "receipts": [
                {"idempotency_key": key, "status": answer.status, "body": answer.body}
                for key, answer in zip(keys, answers, strict=False)
            ]
        },
    )


@documented(_peer_operation("get", "The repo roots advertised for launches", None, ReposAnswer))
@peer_route(method="GET")
def repos(request: HttpRequest, peer: Peer) -> Answer:
    """``GET /api/v1/peers/repos``: 200 ``{"roots": [absolute paths]}`` — the
    ``DISPATCH_REPO_ROOTS`` a launch's ``cwd`` must be inside (``[]``: launches refused)."""
    return Answer(status=200, body={"roots": list(settings.REPO_ROOTS)})


def _agent_action(route: str, act: Callable[..., Any]) -> PeerView:
    def view(request: HttpRequest, peer: Peer, agent_id: str) -> Answer:
        key = receipts.idempotency_key_of(request)
        body = json_object(request)  # an EmptyBody: any object, kept only for the receipt
        return receipts.run_once(
            peer=peer,
            key=key,
            route=route,
            body={"agent_id": agent_id, "body": body},
            act=lambda: Answer(status=200, body=services.launch_answer(act(peer=peer, agent_id=agent_id))),
        )

    view.__name__ = f"agent_{route}"
    view.__doc__ = (
        f"``POST /api/v1/peers/agents/{{agent_id}}/{route}``: {route} an agent this peer launched.\n\n"
        "200 ``{agent_id, name, status}``; 404 for any agent the peer did not launch here; 409 when its "
        "status does not allow it (stop); a repeated key returns the first answer."
    )
    return view


agent_stop = documented(
    _peer_operation("post", "Stop an agent this peer launched (allow_launch)", EmptyBody, PeerAgentAnswer)
)(peer_route(method="POST", capability="allow_launch")(_agent_action("stop", services.peer_agent_stop)))
agent_archive = documented(
    _peer_operation("post", "Archive an agent this peer launched (allow_launch)", EmptyBody, PeerAgentAnswer)
)(peer_route(method="POST", capability="allow_launch")(_agent_action("archive", services.peer_agent_archive)))


@documented(_peer_operation("post", "The peer unlinked us: revoke the link here too", EmptyBody, UnlinkAnswer))
@peer_route(method="POST")
def unlink(request: HttpRequest, peer: Peer) -> Answer:
    """``POST /api/v1/peers/unlink`` (docs/peers.md#unlinking): the peer unlinked us, so we revoke our side
    too (``pairing.peer_mark_unlinked_by_peer``). Needs an ``Idempotency-Key`` like every
    peer POST (no receipt is kept: once revoked, the peer cannot authenticate again).
    200 ``{"unlinked": true}``."""
    receipts.idempotency_key_of(request)
    peer_mark_unlinked_by_peer(peer=peer)
    return Answer(status=200, body={"unlinked": True})


@documented(
    _peer_operation("get", "Pending approvals of the link user's agents here (allow_message)", None, PeerApprovalList)
)
@peer_route(method="GET", capability="allow_message")
def approvals(request: HttpRequest, peer: Peer) -> Answer:
    """``GET /api/v1/peers/approvals`` (docs/peers.md#approvals): 200 ``{"approvals":
    [{id, agent_id, agent_name, tool_name, tool_summary, tool_input, suggestions, status,
    asked_at, expires_at}, …]}`` — the pending approvals of the link user's local agents,
    oldest first (``approval_services.peer_approvals_pending``). 403 without ``allow_message``."""
    return Answer(status=200, body={"approvals": approval_services.peer_approvals_pending(peer=peer)})


@documented(
    _peer_operation(
        "post", "Answer a pending approval of an agent here (allow_message)", ApprovalAnswerBody, PeerApprovalAnswer
    )
)
@peer_route(method="POST", capability="allow_message")
def approval_answer(request: HttpRequest, peer: Peer, approval_id: str) -> Answer:
    """``POST /api/v1/peers/approvals/{id}/answer`` ``{decision, message?, answered_by}``
    (docs/peers.md#approvals): ``approval_services.peer_approval_answer``, once per
    ``Idempotency-Key`` (a repeated key gets the first answer).

    200 ``{id, agent_id, status, decision, answered_by, answered_at}``; 400 for a bad
    body; 403 without ``allow_message``; 404 for an approval of no agent of the link's
    user here; 409 ``APPROVAL_ANSWERED`` (naming who answered) when it was answered
    already — by anyone, this peer included under another key; 422 for another body
    under the key.
    """
    key = receipts.idempotency_key_of(request)
    body = json_object(request)

    def act() -> Answer:
        answer = parse_plain(ApprovalAnswerBody, body, context={PEER_INSTANCE_ID: peer.instance_id})
        return Answer(
            status=200,
            body=approval_services.peer_approval_answer(peer=peer, approval_id=approval_id, answer=answer),
        )

    return receipts.run_once(
        peer=peer, key=key, route="approval_answer", body={"approval_id": approval_id, "body": body}, act=act
    )


api_urlpatterns: list[URLPattern | URLResolver] = [
    path("peers/launch", launch, name="peer-launch"),
    path("peers/messages", messages, name="peer-messages"),
    path("peers/messages/batch", messages_batch, name="peer-messages-batch"),
    path("peers/repos", repos, name="peer-repos"),
    path("peers/agents/<str:agent_id>/stop", agent_stop, name="peer-agent-stop"),
    path("peers/agents/<str:agent_id>/archive", agent_archive, name="peer-agent-archive"),
    path("peers/unlink", unlink, name="peer-unlink"),
    path("peers/approvals", approvals, name="peer-approvals"),
    path("peers/approvals/<str:approval_id>/answer", approval_answer, name="peer-approval-answer"),
]
