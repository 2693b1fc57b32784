"""Writes the peer API makes on this instance for a linked peer (docs/peers.md#the-peer-api), through
the agents app's services (``agents.lifecycle``, ``agents.messages``).

Everything here acts as the link's user (``peer.owner``, docs/peers.md#who-a-link-acts-as):
agents a peer launches are owned by them, messages reach only their local agents, and a
peer may stop or archive only the agents it launched itself. Capabilities (docs/peers.md#permissions) are
checked by ``capability_require`` before any of these run; ``full_access`` launches are
checked here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from django.conf import settings
from django.db import transaction

from agents import lifecycle, messages
from agents import services as agent_services
from agents.launching import launch_type_resolve
from agents.models import Agent, AgentEvent, AgentMessage
from agents.selectors import is_shadow
from agents.serializers import agent_data
from core.errors import DispatchError, InvalidRequest, NotFound
from core.validation import parse_plain
from peers.models import Peer
from peers.protocol import PEER_INSTANCE_ID, LaunchBody, MessageBatchBody, MessageBody
from peers.services import receipts

logger = logging.getLogger(__name__)

# Capability flag → the refusal's message (each route checks its own flag).
CAPABILITY_MESSAGES: dict[str, str] = {
    "allow_launch": "launch is not permitted for this peer",
    "allow_message": "messaging is not permitted for this peer",
    "allow_full_access": "full access is not permitted for this peer",
    "allow_events": "events are not permitted for this peer",
}


def capability_require(*, peer: Peer, flag: str) -> None:
    """Refuse unless ``peer`` was granted ``flag`` (an ``allow_*`` field, docs/peers.md#permissions).

    Raises ``DispatchError("CAPABILITY_NOT_GRANTED")`` (403) with the documented message,
    e.g. "launch is not permitted for this peer". Reads the row as given: the caller
    loads the peer per request, so a changed flag takes effect on the next request.
    """
    if not getattr(peer, flag):
        raise DispatchError("CAPABILITY_NOT_GRANTED", CAPABILITY_MESSAGES[flag])


# --- containment ---------------------------------------------------------------------------


def _outside(cwd: str, roots: list[str]) -> DispatchError:
    return DispatchError(
        "PATH_OUTSIDE_ALLOWED_ROOT",
        f"cwd '{cwd}' is outside the repo roots this instance advertises: {', '.join(roots)}",
        {"cwd": cwd, "roots": roots},
    )


def launch_cwd_resolve(cwd: Any, *, roots: list[str] | None = None) -> str:
    """The directory a peer's launch runs in (docs/peers.md#launch), or a 400 naming the roots.

    ``cwd``: an absolute path, or one starting with ``~`` / ``~/`` (this instance's
    home). Its realpath (symlinks and ``..`` resolved) must be one of ``roots`` (default
    ``settings.REPO_ROOTS``, realpaths) or below one, compared segment by segment (``/a/bc``
    is not inside ``/a/b``), and an existing directory. Raises ``InvalidRequest`` when no
    roots are configured (incoming launches disabled) or for a malformed ``cwd``, and
    ``DispatchError("PATH_OUTSIDE_ALLOWED_ROOT")`` (400, ``details.roots``) otherwise.
    """
    roots = list(settings.REPO_ROOTS if roots is None else roots)
    if not roots:
        raise InvalidRequest(
            "incoming launches are disabled on this instance: DISPATCH_REPO_ROOTS is empty", {"roots": []}
        )
    if not isinstance(cwd, str) or not cwd.strip() or "\x00" in cwd or len(cwd) > 4096:
        raise InvalidRequest(f"cwd must be an absolute directory inside one of: {', '.join(roots)}", {"roots": roots})
    text = cwd.strip()
    if text == "~" or text.startswith("~/"):
        text = os.path.expanduser("~") + text[1:]
    if not os.path.isabs(text):
        raise InvalidRequest(
            f"cwd must be an absolute path (or start with ~/), not '{cwd}'; repo roots: {', '.join(roots)}",
            {"roots": roots},
        )
    real = os.path.realpath(text)
    parts = _segments(real)
    if not any(parts[: len(root_parts)] == root_parts for root_parts in map(_segments, roots)):
        raise _outside(cwd, roots)
    if not os.path.isdir(real):
        raise InvalidRequest(f"cwd '{cwd}' is not an existing directory", {"roots": roots})
    return real


def _segments(path: str) -> list[str]:
    return [part for part in os.path.normpath(path).split(os.sep) if part]


# --- launch ---------------------------------------------------------------------------------


def launch_preamble(*, peer: Peer, launched_by: dict[str, Any]) -> str:
    """The text a peer-launched agent gets first (docs/peers.md#using-a-link), ending in a blank line.

    Names the linked instance by this instance's label for it and the launcher by its
    address here, ``<label>:<agent id>`` (what ``dispatch_send_message`` takes), or,
    for a person (``agent_id`` null), by their name.
    """
    instance = f'the linked Dispatch instance "{peer.label}"'
    if launched_by.get("agent_id"):
        address = f"{peer.label}:{launched_by['agent_id']}"
        return (
            f'[Dispatch] You were launched from {instance} by its agent "{launched_by["name"]}" '
            f"(address {address}). You share none of that agent's context: everything you need is in "
            f"the instructions below. Send replies and results to {address} with dispatch_send_message.\n\n"
        )
    return (
        f'[Dispatch] You were launched from {instance} by "{launched_by["name"]}", a person there. '
        "You share none of their context: everything you need is in the instructions below.\n\n"
    )


def _kind(type: str) -> str:
    if type == agent_services.EXPERT:
        return "llm"
    spec = settings.AGENT_TYPES.get(type)
    return str(spec.kind) if spec is not None else "llm"


def peer_launch_here(*, peer: Peer, launch: LaunchBody) -> Agent:
    """Launch an agent here for ``peer`` (``POST /api/v1/peers/launch``) and return it.

    ``launch``: the validated body (``LaunchBody``, context ``{"peer_instance_id":
    peer.instance_id}``). Its ``type`` defaults to what a local launch gets
    (``launch_type_resolve``: 400 listing the available types when there is no default). ``cwd`` as
    ``launch_cwd_resolve``. ``child`` has no effect here (the parent lives on the peer,
    as the shadow's parent). The agent is owned by ``peer.owner`` and records
    ``launched_by_peer``; an ``llm``-kind agent's prompt starts with ``launch_preamble``;
    a ``shell`` agent gets the prompt alone and the preamble in
    ``DISPATCH_LAUNCH_CONTEXT`` (its session reads ``launched_by_peer`` through
    ``agents.hooks.linked().launch_context``).
    Raises ``CAPABILITY_NOT_GRANTED`` (403, ``full_access`` without
    ``allow_full_access``), then ``InvalidRequest`` / ``PATH_OUTSIDE_ALLOWED_ROOT`` (400,
    unknown or unavailable type, cwd outside the roots).
    """
    full_access = launch.full_access
    launched_by = launch.launched_by.wire()
    prompt = launch.prompt
    if full_access:
        capability_require(peer=peer, flag="allow_full_access")
    cwd = launch_cwd_resolve(launch.cwd)
    type = launch_type_resolve(launch.type)  # after every check of the body, in LaunchBody's order
    if _kind(type) == "llm":
        prompt = launch_preamble(peer=peer, launched_by=launched_by) + prompt
    # The agent is created with its launched_by_peer (a shell agent's session reads it for
    # DISPATCH_LAUNCH_CONTEXT); a CLI launch is not in a transaction (its tmux session
    # outlives the request).
    agent = lifecycle.agent_launch_any(
        owner=peer.owner,
        type=type,
        name=launch.name,
        prompt=prompt,
        cwd=cwd,
        full_access=full_access,
        launched_by_peer=launched_by,
    )
    return _record_launched_by_peer(agent=agent, peer=peer, launched_by=launched_by)


@transaction.atomic
def _record_launched_by_peer(*, agent: Agent, peer: Peer, launched_by: dict[str, Any]) -> Agent:
    by = f"agent {peer.label}:{launched_by['agent_id']}" if launched_by["agent_id"] else launched_by["name"]
    agent_services.agent_event_record(
        agent=agent,
        type=AgentEvent.Type.SYSTEM,
        message=f"launched from linked instance {peer.label} by {by}",
        metadata={"launched_by_peer": launched_by},
    )
    agent.refresh_from_db()
    agent_services.publish_on_commit(user_id=agent.owner_id, event="agent.upsert", data=agent_data(agent))
    return agent


def launch_answer(agent: Agent) -> dict[str, Any]:
    """The 201 body of a peer launch: ``{agent_id, name, status}``."""
    return {"agent_id": agent.pk, "name": agent.name, "status": agent.status}


# --- messages -------------------------------------------------------------------------------


def _undeliverable(agent_id: str, reason: str, status: str | None = None) -> DispatchError:
    details: dict[str, Any] = {"to_agent_id": agent_id}
    if status is not None:
        details["status"] = status
    return DispatchError("CONFLICT", f"agent '{agent_id}' cannot take messages: {reason}", details)


def peer_message_here(*, peer: Peer, message: MessageBody, idempotency_key: str) -> AgentMessage:
    """Deliver ``peer``'s message to one of the link user's local agents (docs/peers.md#messages).

    ``message``: the validated body (``MessageBody``, context ``{"peer_instance_id":
    peer.instance_id}``). Records an ``AgentMessage`` with ``sender_peer`` / ``peer`` =
    ``peer``, ``sender_address`` = ``from`` and the key, through ``messages.message_send``:
    an expert recipient gets a queued run and the message is ``delivered``; a CLI
    recipient's message is ``queued`` and its supervisor's doorbell rung after commit;
    ``message.created`` is announced after commit. Call inside the caller's transaction
    (with the receipt). Raises ``DispatchError("CONFLICT")`` (409, permanent: no such
    agent of the link user, a shadow, archived or not running).
    """
    to_agent_id = message.to_agent_id
    recipient = Agent.objects.select_for_update().filter(pk=to_agent_id, owner=peer.owner).first()
    if recipient is None:
        raise _undeliverable(to_agent_id, "no such agent")
    if is_shadow(recipient):
        raise _undeliverable(to_agent_id, "it is a shadow agent")
    accepting = {Agent.Status.RUNNING} if recipient.type == agent_services.EXPERT else messages.CLI_ACCEPTING
    if recipient.status not in accepting:
        raise _undeliverable(to_agent_id, f"it is not running (status {recipient.status})", recipient.status)
    # The same rules as every local message (a run for an expert, a paste for a CLI agent).
    return messages.message_send(
        recipient=recipient,
        content=message.content,
        sender_peer=peer,
        sender_address=message.sender.wire(),
        idempotency_key=idempotency_key,
    )


# --- stop / archive ---------------------------------------------------------------------------


def peer_launched_agent(*, peer: Peer, agent_id: Any) -> Agent:
    """A local agent ``peer`` launched here (``launched_by_peer.instance_id`` is the peer's,
    owned by the link user), else ``NotFound`` (404, never telling other agents apart)."""
    if not isinstance(agent_id, str) or not 0 < len(agent_id) <= 64:
        raise NotFound("no such agent launched by this peer")
    agent = Agent.objects.filter(
        pk=agent_id, owner=peer.owner, launched_by_peer__instance_id=peer.instance_id, peer__isnull=True
    ).first()
    if agent is None:
        raise NotFound(f"no agent '{agent_id}' launched by this peer")
    return agent


def peer_agent_stop(*, peer: Peer, agent_id: str) -> Agent:
    """Stop an agent ``peer`` launched here (``lifecycle.agent_stop_any``).

    Raises ``NotFound`` (404) for any other agent and ``DispatchError("CONFLICT")`` (409)
    when it cannot stop from its status (already stopped, archived).
    """
    agent = peer_launched_agent(peer=peer, agent_id=agent_id)
    return lifecycle.agent_stop_any(agent=agent)


def peer_agent_archive(*, peer: Peer, agent_id: str) -> Agent:
    """Archive an agent ``peer`` launched here (idempotent; ``lifecycle.agent_archive_any``).

    Raises ``NotFound`` (404) for any other agent.
    """
    agent = peer_launched_agent(peer=peer, agent_id=agent_id)
    return lifecycle.agent_archive_any(agent=agent)


def _message_deliver(*, peer: Peer, idempotency_key: str, body: dict[str, Any]) -> receipts.Answer:
    """The receipt and the message, inside the caller's transaction (``peer_message_deliver``)."""
    opened = receipts.receipt_open(peer=peer, key=idempotency_key, route="messages", body=body)
    if isinstance(opened, receipts.Answer):
        return receipts.Answer(status=200, body={"delivered": True, "duplicate": True}, replayed=True)
    message = parse_plain(MessageBody, body, context={PEER_INSTANCE_ID: peer.instance_id})
    delivered = peer_message_here(peer=peer, message=message, idempotency_key=idempotency_key)
    answer = receipts.Answer(status=200, body={"delivered": True, "message_id": delivered.pk})
    receipts.receipt_close(receipt=opened, answer=answer)
    return answer


def peer_message_deliver(*, peer: Peer, idempotency_key: str, body: dict[str, Any]) -> receipts.Answer:
    """``POST /api/v1/peers/messages``: the receipt and the message in one transaction.

    ``body``: the request's JSON object. New key → the body is validated
    (``MessageBody``), then ``peer_message_here``, and 200 ``{"delivered": true,
    "message_id"}`` is stored in the receipt. Repeated key, same body → 200 ``{"delivered":
    true, "duplicate": true}`` without delivering again. Raises ``IdempotencyKeyReused``
    (422) for another body under the key — whatever that body is: the receipt is opened
    before the body is judged — then ``InvalidRequest`` (400, the model's
    sentence), then what ``peer_message_here`` raises (409 when the agent is gone or not
    running). On any error the transaction rolls back, so the receipt is removed with the
    message and a retry under the same key is judged afresh.
    """
    with transaction.atomic():
        return _message_deliver(peer=peer, idempotency_key=idempotency_key, body=body)


def message_unavailable_answer() -> receipts.Answer:
    """503 ``TEMPORARILY_UNAVAILABLE``: a message could not be delivered now for a reason
    that is not its own (the sender retries with the same Idempotency-Key)."""
    return receipts.Answer(
        status=503,
        body={
            "error": {
                "code": "TEMPORARILY_UNAVAILABLE",
                "message": "the message could not be delivered now; retry with the same Idempotency-Key",
                "details": {},
            }
        },
    )


def peer_messages_deliver(*, peer: Peer, batch: MessageBatchBody) -> list[receipts.Answer]:
    """``POST /api/v1/peers/messages/batch`` (feature ``messages.batch``): each message of
    ``batch``, in order, exactly as ``peer_message_deliver`` would deliver it alone — its
    receipt under its own ``idempotency_key`` (route ``messages``, digest of its
    ``{to_agent_id, content, from}``, so a message first sent alone and then in a batch, or
    the reverse, is still delivered once), its validation, its ``AgentMessage``.

    Returns one ``Answer`` per message handled, in order: 200 delivered or duplicate (a
    replayed batch is answered from the receipts, delivering nothing again); a
    ``DispatchError`` (400, 409, 422: refused for good — that message's work and receipt are
    rolled back, the next message goes on); an unexpected failure → 503 and **stop**: the
    messages after it get no answer (the sender keeps them queued, in order). Every message
    runs in a savepoint of one transaction, so the batch costs one commit; the messages
    handled before a failure are committed with it.
    """
    answers: list[receipts.Answer] = []
    with transaction.atomic():
        for entry in batch.messages:
            key = entry["idempotency_key"]
            body = {name: value for name, value in entry.items() if name != "idempotency_key"}
            try:
                with transaction.atomic():
                    answers.append(_message_deliver(peer=peer, idempotency_key=key, body=body))
            except DispatchError as exc:
                answers.append(receipts.Answer(status=exc.http_status, body=exc.as_dict()))
            except Exception:
                logger.exception("delivering message %s of a batch from peer %s failed", key, peer.label)
                answers.append(message_unavailable_answer())
                break
    return answers
