"""The launching side of peers (docs/peers.md#using-a-link): locations, launching
on a peer with its local shadow, forwarding a shadow's stop and archive, and what the
agents app's domain code asks of linked instances (``PeerLinks``, registered in ``agents.hooks``).

- ``peer_launch`` (async): resolve ``location``, require ``cwd`` (the error lists the peer's
  repo roots from ``GET /api/v1/peers/repos``), ``POST /api/v1/peers/launch`` (30 s,
  ``Idempotency-Key``), then create the shadow seeded from the answer
  (``peers.services.shadows.shadow_record_launch``) and ask the mirror to re-snapshot the
  peer.
- ``shadow_forward`` (async): ``stop`` / ``archive`` of a shadow sent to its peer as
  ``POST /api/v1/peers/agents/{peer_agent_id}/stop|archive``.
- ``peer_address_parse``: ``<label or instance id>:<agent id>`` recognised by shape.
- ``launch_at_location`` (async): the REST launch's and the launch tool's "at a location"
  branch, written once.
- ``PeerLinks``: what agents' domain code needs of peers (``agents.hooks``): a shadow's
  ``forward``, ``message_send`` (``peers.services.outgoing.peer_message_send``: the
  ``AgentMessage`` and its ``OutboxMessage`` in one transaction; the drain,
  ``peers.outbox_drain``, delivers it) and a peer-launched agent's ``launch_context``.

Peer HTTP calls are async (``peers.client.PeerClient``); database work runs through
``database_sync_to_async`` in short steps, never across a network wait. Every write is a
service: the shadows' rows ``peers.services.shadows``, messages
``peers.services.outgoing``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx
from channels.db import database_sync_to_async
from django.contrib.auth.models import User
from django.utils import timezone

from agents import services as agent_services
from agents.hooks import Link
from agents.models import Agent, AgentMessage
from agents.selectors import AGENT_ID, PEER_ADDRESS, is_shadow, shadow_link
from core.errors import DispatchError, InvalidRequest, NotFound
from peers.client import PeerClient, PeerUnreachable
from peers.mirror import mirror_resnapshot
from peers.models import Peer, new_idempotency_key
from peers.selectors import peer_resolve_location, peers_for
from peers.services import shadows
from peers.services.incoming import launch_preamble
from peers.services.outgoing import launcher_address, peer_message_send

logger = logging.getLogger(__name__)

LAUNCH_TIMEOUT = 30.0  # seconds
FORWARD_TIMEOUT = 30.0
FORWARDED = ("stop", "archive")


# --- locations and addresses -------------------------------------------------------------------


def location_resolve(*, user: User, location: str) -> Peer:
    """The live peer of ``user`` that ``location`` names: its label or its instance id,
    case-insensitive (docs/peers.md#labels; ``peers.selectors.peer_resolve_location``).

    Raises ``InvalidRequest`` (an argument that names nothing usable): no match (the
    message lists the user's labels and says to omit location to launch here), or
    ambiguous (listing the matches). Another user's peer is never matched.
    """
    try:
        return peer_resolve_location(user=user, location=location)
    except NotFound as exc:
        raise InvalidRequest(f"{exc.message}; omit location to launch here", exc.details) from None


def peer_address_parse(*, user: User, target: str) -> tuple[Peer, str] | None:
    """``(peer, agent id there)`` when ``target`` has the shape ``<label or instance id>:agt_<12 hex>``
    and the part before the colon names one of ``user``'s live peers; else ``None`` (the
    target is then a local id or name: "fix: sse race" is a name).

    Raises ``InvalidRequest`` when the prefix is ambiguous.
    """
    matched = PEER_ADDRESS.match(target.strip())
    if matched is None:
        return None
    try:
        peer = peer_resolve_location(user=user, location=matched["peer"])
    except NotFound:
        return None
    return peer, matched["agent"]


def linked_instances_text(*, user: User) -> str:
    """The linked-instances sentence of ``dispatch_launch_agent``'s description (docs/mcp.md#tools):
    each live peer of ``user`` as ``<label> (<instance id>)``, flagged "not responding
    recently" (``Peer.responding``) and with its ``Peer.launch_refusal`` ("launching not
    permitted": the peer reported ``allow_launch`` false); or, with none, that
    ``location`` is to be omitted."""
    peers = list(peers_for(user=user))
    if not peers:
        return "There are no linked instances: omit location to launch locally."
    now = timezone.now()
    items = []
    for peer in peers:
        flags = []
        if not peer.responding(now):
            flags.append("not responding recently")
        refusal = peer.launch_refusal()
        if refusal:
            flags.append(refusal)
        items.append(f"{peer.label} ({peer.instance_id}" + "".join(f", {flag}" for flag in flags) + ")")
    return (
        "location launches on a linked instance (its label or instance id; cwd is then required and is a "
        "directory there); omit it to launch here. Linked instances: " + "; ".join(items) + "."
    )


# --- answers from the peer ---------------------------------------------------------------------


def _peer_error(peer: Peer, response: httpx.Response, what: str) -> DispatchError:
    """A ``DispatchError`` for a peer's non-2xx answer: its own code and message, prefixed
    with the peer's label; an authentication refusal (401) becomes ``PERMISSION_DENIED``."""
    code, message = "REMOTE_ERROR", ""
    details: dict[str, Any] = {}
    try:
        error = response.json()["error"]
        code = str(error.get("code") or code)
        message = str(error.get("message") or "")
        details = error.get("details") if isinstance(error.get("details"), dict) else {}
    except Exception:
        message = response.text[:300]
    if response.status_code == 401:
        return DispatchError(
            "PERMISSION_DENIED",
            f"{peer.label} refused this instance's credentials ({message or 'unauthorized'}): the link may have "
            "been removed on the other side",
            {"peer": peer.label},
        )
    if response.status_code >= 500 or code.upper() != code or " " in code:
        code = "REMOTE_ERROR"
    return DispatchError(
        code,
        f"{what} on {peer.label} failed: {message or response.reason_phrase} (HTTP {response.status_code})",
        {**details, "peer": peer.label, "status": response.status_code},
    )


def _unreachable(peer: Peer, exc: PeerUnreachable) -> DispatchError:
    return DispatchError("REMOTE_ERROR", exc.message, {"peer": peer.label})


def _json_object(peer: Peer, response: httpx.Response, what: str) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise DispatchError(
            "INVALID_RESPONSE", f"{peer.label} answered {what} with something that is not a JSON object"
        )
    return body


async def peer_repo_roots(peer: Peer) -> list[str]:
    """The directories ``peer`` advertises for launches (``GET /api/v1/peers/repos``; the
    answer is ``{"roots": [...]}``). Raises ``DispatchError`` when unreachable or refused."""
    try:
        response = await PeerClient(peer, timeout=LAUNCH_TIMEOUT).get("/api/v1/peers/repos")
    except PeerUnreachable as exc:
        raise _unreachable(peer, exc) from None
    if not 200 <= response.status_code < 300:
        raise _peer_error(peer, response, "listing repo roots")
    body = _json_object(peer, response, "the repo roots")
    roots = body.get("roots", body.get("repo_roots", []))
    return [str(root) for root in roots] if isinstance(roots, list) else []


# --- launching ---------------------------------------------------------------------------------


def _resnapshot(peer_id: int) -> None:
    """Ask the mirroring subscriber to re-snapshot ``peer_id`` (``peers.mirror.mirror_resnapshot``);
    a failure is logged, and the next snapshot then comes with the next reconnect."""
    try:
        mirror_resnapshot(peer_id)
    except Exception:
        logger.exception("could not ask for a re-snapshot of peer %s", peer_id)


async def peer_launch(
    *,
    user: User,
    caller_agent: Agent | None,
    location: str,
    name: str,
    prompt: str,
    type: str | None,
    cwd: str | None,
    child: bool,
    full_access: bool,
) -> Agent:
    """Launch an agent on the peer ``location`` names and return its local shadow.

    ``cwd`` is required (a directory on the peer; the refusal lists the peer's repo roots).
    Posts ``{name, prompt, type?, cwd, full_access, child, launched_by: {instance_id,
    agent_id | null, name}}`` to ``/api/v1/peers/launch`` with a fresh ``Idempotency-Key``
    and a 30 s timeout; the answer ``{agent_id, name, status}`` seeds the shadow
    (``shadow_record_launch``: ``launched_by`` = ``caller_agent``, ``parent`` too when
    ``child``). Then asks the mirror to re-snapshot that peer.

    Raises ``InvalidRequest`` (location unknown or ambiguous, no cwd, bad name),
    ``DispatchError`` with the peer's code (``CAPABILITY_NOT_GRANTED``,
    ``PATH_OUTSIDE_ALLOWED_ROOT`` …) for its refusals, ``PERMISSION_DENIED`` when it no
    longer accepts our token, ``REMOTE_ERROR`` when unreachable or failing,
    ``INVALID_RESPONSE`` for an answer without a proper agent id or status.
    """
    peer = await database_sync_to_async(location_resolve)(user=user, location=location)
    if not isinstance(name, str) or not name.strip() or len(name.strip()) > agent_services.MAX_NAME_LENGTH:
        raise InvalidRequest(f"name must be 1 to {agent_services.MAX_NAME_LENGTH} characters")
    if not cwd or not str(cwd).strip():
        roots = await peer_repo_roots(peer)
        listed = ", ".join(roots) if roots else f"none ({peer.label} accepts no launches)"
        raise InvalidRequest(
            f"cwd is required to launch on {peer.label}: a directory inside one of its repo roots: {listed}",
            {"peer": peer.label, "roots": roots},
        )
    launched_by = await database_sync_to_async(launcher_address)(user=user, caller_agent=caller_agent)
    body: dict[str, Any] = {
        "name": name.strip(),
        "prompt": prompt or "",
        "cwd": str(cwd).strip(),
        "full_access": bool(full_access),
        "child": bool(child),
        "launched_by": launched_by,
    }
    if type:
        body["type"] = type
    try:
        response = await PeerClient(peer, timeout=LAUNCH_TIMEOUT).post(
            "/api/v1/peers/launch", body, idempotency_key=new_idempotency_key()
        )
    except PeerUnreachable as exc:
        raise _unreachable(peer, exc) from None
    if not 200 <= response.status_code < 300:
        raise _peer_error(peer, response, "launching")
    answer = _json_object(peer, response, "the launch")
    agent_id, status = answer.get("agent_id"), answer.get("status")
    if not isinstance(agent_id, str) or not AGENT_ID.match(agent_id) or status not in Agent.Status.values:
        raise DispatchError(
            "INVALID_RESPONSE",
            f"{peer.label} answered the launch without a proper agent id and status",
            {"answer": answer},
        )
    shadow = await database_sync_to_async(shadows.shadow_record_launch)(
        peer=peer,
        peer_agent_id=agent_id,
        name=str(answer.get("name") or name.strip()),
        type=type or "",
        status=status,
        cwd=body["cwd"],
        launched_by=caller_agent,
        child=child,
    )
    await database_sync_to_async(_resnapshot)(peer.pk)
    return shadow


async def launch_at_location(
    *, user: User, caller_agent: Agent | None, location: str, fields: Mapping[str, Any]
) -> Agent:
    """A launch "at a location" as both of its edges ask for it — ``POST /api/v1/agents`` with
    ``location`` and the ``dispatch_launch_agent`` tool (docs/peers.md#using-a-link): ``peer_launch``
    with the request's ``fields`` (``name``, ``prompt``, ``type``, ``cwd``, ``child``,
    ``full_access``; an empty ``type`` or ``cwd`` is none, ``child`` defaults to true and needs a
    ``caller_agent``). Returns the local shadow; raises as ``peer_launch``."""
    return await peer_launch(
        user=user,
        caller_agent=caller_agent,
        location=str(location),
        name=fields["name"],
        prompt=fields.get("prompt", ""),
        type=fields.get("type") or None,
        cwd=fields.get("cwd") or None,
        child=bool(fields.get("child", True)) and caller_agent is not None,
        full_access=bool(fields.get("full_access", False)),
    )


# --- forwarding a shadow's lifecycle -----------------------------------------------------------


def _shadow_state(agent: Agent) -> tuple[Agent, Peer | None]:
    current = Agent.objects.select_related("peer", "owner").get(pk=agent.pk)
    return current, current.peer if shadow_link(current) is not None else None


async def shadow_forward(*, agent: Agent, action: str) -> Agent:
    """Forward ``stop`` or ``archive`` of the shadow ``agent`` to its peer (docs/peers.md#shadow-agents:
    ``POST /api/v1/peers/agents/{peer_agent_id}/stop|archive``, needs
    ``allow_launch`` there and only for agents this instance launched there).

    ``stop``: the shadow takes the status the peer answers (``{status}``), else keeps its
    own until the mirror reports. ``archive``: the shadow is archived locally once the peer
    accepted — or at once, without asking, when its link is revoked or the peer no longer
    knows the agent (404). ``start`` is not part of the peer API: ``UNSUPPORTED_OPERATION``.
    Raises ``InvalidRequest`` for a local agent, the peer's refusals as ``DispatchError``
    (e.g. 403 ``CAPABILITY_NOT_GRANTED``), ``REMOTE_ERROR`` when unreachable.
    """
    if action not in FORWARDED:
        raise DispatchError(
            "UNSUPPORTED_OPERATION",
            f"agent '{agent.pk}' is a shadow agent: {action} it on its own instance (only stop and archive are "
            "forwarded to a linked instance)",
        )
    current, peer = await database_sync_to_async(_shadow_state)(agent)
    if not is_shadow(current):
        raise InvalidRequest(f"agent '{current.pk}' is not a shadow agent")
    if current.status == Agent.Status.ARCHIVED:
        return current
    if peer is None:
        if action == "archive":
            return await database_sync_to_async(shadows.shadow_settle)(
                agent_id=current.pk, status=Agent.Status.ARCHIVED, note="archived here (its link is gone)"
            )
        raise DispatchError(
            "CONFLICT", f"agent '{current.pk}' belongs to a link that was removed: it cannot be stopped"
        )
    try:
        response = await PeerClient(peer, timeout=FORWARD_TIMEOUT).post(
            f"/api/v1/peers/agents/{current.peer_agent_id}/{action}", {}, idempotency_key=new_idempotency_key()
        )
    except PeerUnreachable as exc:
        raise _unreachable(peer, exc) from None
    if action == "archive" and (200 <= response.status_code < 300 or response.status_code == 404):
        gone = response.status_code == 404
        note = (
            f"archived here only: {peer.label} answered 404 (the agent is gone there, or it was not launched from "
            "this instance, so only its own user can archive it there)"
            if gone
            else f"archived on {peer.label}"
        )
        return await database_sync_to_async(shadows.shadow_settle)(
            agent_id=current.pk, status=Agent.Status.ARCHIVED, note=note
        )
    if not 200 <= response.status_code < 300:
        raise _peer_error(peer, response, "stopping" if action == "stop" else "archiving")
    status = None
    try:
        answer = response.json()
        status = answer.get("status") if isinstance(answer, dict) else None
    except ValueError:
        pass
    if status in Agent.Status.values and status != Agent.Status.ARCHIVED:
        return await database_sync_to_async(shadows.shadow_settle)(
            agent_id=current.pk, status=status, note=f"stop forwarded to {peer.label}"
        )
    return current


# --- what the agents app's domain code asks of peers (agents.hooks) ---------------------------


def _peer(link: Link) -> Peer:
    if not isinstance(link, Peer):
        raise TypeError(f"not a peer: {link!r}")
    return link


class PeerLinks:
    """``agents.hooks.LinkedInstances`` as ``peers`` does it, registered in
    ``PeersConfig.ready``: what agents' domain code (``agents.lifecycle``, ``agents.cli``),
    which may not import ``peers``, needs of linked instances. The agents app's edges
    (REST, pages, tools) import ``peers`` directly (docs/architecture.md#the-layers)."""

    forward = staticmethod(shadow_forward)

    def message_send(
        self, *, user: User, sender_agent: Agent | None, link: Link, to_agent_id: str, content: str
    ) -> AgentMessage:
        """``peer_message_send`` to ``link`` (a ``Peer``)."""
        return peer_message_send(
            user=user, sender_agent=sender_agent, peer=_peer(link), to_agent_id=to_agent_id, content=content
        )

    def launch_context(self, *, agent: Agent) -> str | None:
        """``launch_preamble`` (without its blank line) for an agent the live peer named by
        ``agent.launched_by_peer.instance_id`` launched here; ``None`` otherwise."""
        if not agent.launched_by_peer:
            return None
        peer = Peer.objects.filter(
            owner_id=agent.owner_id, instance_id=agent.launched_by_peer.get("instance_id"), revoked_at__isnull=True
        ).first()
        return launch_preamble(peer=peer, launched_by=agent.launched_by_peer).strip() if peer is not None else None
