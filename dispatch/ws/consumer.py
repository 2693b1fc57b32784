"""The ``/ws`` session consumer (docs/ws-protocol.md).

A thin edge: it authenticates, parses the action envelope, calls services and replies.
Its own state is only what belongs to this one connection: the remotes it serves and the
calls pending on it, by request id (ids are unique for good, ``remotes.protocol.new_request_id``).
The registry is in the database.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull
from django.conf import settings

from agents.lifecycle import agent_prompt_any
from agents.protocol import SendAgentPromptBody, UserEventMessage, agent_event_frame, run_finished_frame
from core import wire
from core.consumers import receives
from core.errors import DispatchError
from core.protocol import ServerShutdownMessage
from core.ratelimit import TokenBucket
from core.realtime import layer_send
from core.services import AuthenticationFailed
from dispatch.ws.auth import (
    AUTH_FAILED,
    CLOSE_ORIGIN_REFUSED,
    CLOSE_SERVICE_RESTART,
    CLOSE_TOO_BIG,
    AuthenticatingConsumer,
    api_token_of,
)
from dispatch.ws.frames import (
    AgentEventFrame,
    AnyReply,
    CallResultReply,
    EncodedFrame,
    ErrorReply,
    Nonce,
    PongReply,
    PromptMessageReply,
    PromptRunReply,
    RemoteConnectedReply,
    RemoteDisconnectedEvent,
    RemoteDisconnectedReply,
    RemoteListReply,
    RunFinishedFrame,
    reply,
)
from dispatch.ws.protocol import (
    Action,
    NoBody,
    any_body,
    json_type,
    readable_nonce,
    remote_call_body,
    remote_call_result_body,
    remote_connect_body,
    remote_name_body,
    send_agent_prompt_body,
    utf8_length,
    utf8_over,
)
from remotes import services
from remotes.inflight import session_calls_refusal
from remotes.protocol import (
    RemoteCallBody,
    RemoteCallMessage,
    RemoteCallReply,
    RemoteCallResult,
    RemoteConnectBody,
    RemoteDisconnectedMessage,
    RemoteNameBody,
    RemoteProbeMessage,
    RemoteProbeReply,
    new_request_id,
    remote_call_event,
)
from remotes.selectors import remote_list_for

logger = logging.getLogger(__name__)

CALLER_NOT_READING = "remote call refused: this session has not read the replies it was already sent"
PENDING_GRACE = 5.0  # seconds a pending call is kept past its caller's timeout


@dataclass
class ServedRemote:
    """A remote served by this session: its name."""

    name: str


@dataclass
class PendingCall:
    """A downstream call sent to this session's client, awaiting ``remote-call-result``."""

    remote_id: int
    remotename: str
    reply_channel: str
    expires_at: float


class SessionConsumer(AuthenticatingConsumer):
    """One ws session: the four ways to authenticate, the action envelope, remotes."""

    async def connect(self) -> None:
        # Accept first: custom close codes need an accepted socket (docs/ws-protocol.md#authentication).
        await self.accept()
        self.user = None
        self.ws_session_id = None
        self.events_group = None
        self.served: dict[int, ServedRemote] = {}
        self.own_disconnects: set[int] = set()  # remote ids this session is disconnecting itself
        self.pending: dict[str, PendingCall] = {}
        self.calls: set[asyncio.Task[None]] = set()
        self.bucket = TokenBucket(rate=settings.WS_RATE, burst=settings.WS_BURST)
        self.closing = False
        self.auth_deadline: asyncio.Task[None] | None = None

        header_token = self.bearer_token()
        if header_token is not None:
            try:
                token = await api_token_of(header_token)
            except AuthenticationFailed:
                await self._refuse(AUTH_FAILED)
                return
            await self._authenticated(token.user, "header", api_token_id=token.pk)
            return
        cookie_user = self.scope.get("user")
        if cookie_user is not None and cookie_user.is_authenticated:
            if not self._origin_allowed():
                await self._refuse("origin not allowed", code=CLOSE_ORIGIN_REFUSED)
                return
            session = self.scope.get("session")
            await self._authenticated(cookie_user, "cookie", session_key=getattr(session, "session_key", None) or "")
            return
        self.auth_deadline = asyncio.ensure_future(self._expire_auth())

    async def delete_rows(self) -> None:
        """Cleanup, first step (``DispatchConsumer``): stop local work, delete the ws session
        and, by cascade, the remotes it served."""
        self.closing = True
        if getattr(self, "auth_deadline", None) is not None and self.auth_deadline is not None:
            self.auth_deadline.cancel()
        for task in list(getattr(self, "calls", ())):
            task.cancel()
        if getattr(self, "ws_session_id", None):
            await database_sync_to_async(services.ws_session_close)(ws_session_id=self.ws_session_id)

    async def release_layer(self) -> None:
        """Cleanup, second step: answer the calls pending on this session, leave the events group."""
        for request_id in list(getattr(self, "pending", {})):
            await self.layer_quietly(self._fail_pending(request_id), "answer a pending call")
        if getattr(self, "events_group", None):
            await self.layer_quietly(
                self.channel_layer.group_discard(self.events_group, self.channel_name), "leave the events group"
            )

    # --- frames from the client -------------------------------------------------------

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.closing:
            # Frames that arrive after we closed (e.g. right behind a refused header token)
            # have no one to answer: sending would fail on the closed socket.
            return
        limit = settings.WS_MAX_MESSAGE_BYTES
        if len(bytes_data) > limit if bytes_data is not None else utf8_over(text_data or "", limit):
            await self.close(code=CLOSE_TOO_BIG)
            return
        if self.user is None:
            await self._first_frame(text_data)
            return
        if bytes_data is not None:
            await self._send(ErrorReply(error="binary frames are not supported; send JSON text"))
            return
        try:
            message = wire.loads(text_data or "")
        except ValueError as exc:
            refused = wire.lenient_object(text_data or "")
            if await self._fail_refused_result(refused, str(exc)):
                return
            # The error carries the nonce when one can be read (docs/ws-protocol.md#frames).
            await self._limited_error(f"invalid JSON: {exc}", nonce=readable_nonce(refused))
            return
        if not isinstance(message, dict):
            await self._limited_error(f"a message must be a JSON object, got {json_type(message)}")
            return
        nonce = message.get("nonce")
        if nonce is not None and (isinstance(nonce, bool) or not isinstance(nonce, (str, int, float))):
            await self._limited_error("nonce must be a string or a number")
            return
        action = message.get("action")
        # An action may be any JSON value here; a list or object is unhashable. An unknown
        # action counts against the limit like any limited one.
        entry = self.ACTIONS.get(action) if isinstance(action, str) else None
        if (entry is None or entry.limited) and not self.bucket.take():
            await self._reply(ErrorReply(error="rate limited"), nonce)
            return
        if not isinstance(action, str) or not action:
            await self._reply(ErrorReply(error="missing 'action' (a non-empty string)"), nonce)
            return
        if entry is None:
            await self._reply(ErrorReply(error=f"unknown action '{action[:100]}'"), nonce)
            return
        body = message.get("body", {})
        if body is None:
            body = {}
        try:
            # The body becomes the action's model here, then its handler acts on it.
            await entry.handler(self, entry.parse(message, body), nonce)
        except DispatchError as exc:
            await self._reply(ErrorReply(error=exc.message), nonce)
        except Exception:
            logger.exception("action %s failed", action)
            await self._reply(ErrorReply(error="internal error"), nonce)

    async def _limited_error(self, error: str, nonce: Nonce | None = None) -> None:
        if not self.bucket.take():
            error = "rate limited"
        await self._reply(ErrorReply(error=error), nonce)

    # --- actions (docs/ws-protocol.md#actions) ----------------------------------------

    async def do_ping(self, parsed: NoBody, nonce: Nonce | None) -> None:
        await self._reply(PongReply(pong=True), nonce)

    async def do_remote_connect(self, parsed: RemoteConnectBody, nonce: Nonce | None) -> None:
        assert self.user is not None and self.ws_session_id is not None
        remote = await services.remote_connect_probing(
            user=self.user,
            ws_session_id=self.ws_session_id,
            channel_name=self.channel_name,
            remotename=parsed.remotename,
            tools=parsed.tools,
        )
        self.served[remote.pk] = ServedRemote(name=remote.name)
        await self._reply(RemoteConnectedReply(message="remote connected", remotename=remote.name), nonce)

    async def do_remote_disconnect(self, parsed: RemoteNameBody, nonce: Nonce | None) -> None:
        # A remote this session serves itself: no remote-disconnected event back to it.
        own = {remote_id for remote_id, served in self.served.items() if served.name == parsed.remotename}
        self.own_disconnects |= own
        try:
            await database_sync_to_async(services.remote_disconnect)(user=self.user, remotename=parsed.remotename)
        except BaseException:
            self.own_disconnects -= own
            raise
        await self._reply(RemoteDisconnectedReply(message="remote disconnected", remotename=parsed.remotename), nonce)

    async def do_remote_list(self, parsed: NoBody, nonce: Nonce | None) -> None:
        remotes = await database_sync_to_async(remote_list_for)(user=self.user)
        await self._reply(RemoteListReply(remotes=remotes), nonce)

    async def do_remote_call(self, parsed: RemoteCallBody, nonce: Nonce | None) -> None:
        if not self.send_pressure.has_room():
            # This client has not read the replies it was already sent: its next result
            # would wait in this process's memory too (docs/operating.md#bounds).
            await self._reply(ErrorReply(error=CALLER_NOT_READING), nonce)
            return
        # Counted here too, before the arguments are checked: a call waiting for its route
        # already holds them (remotes.inflight counts the rest, with their bytes).
        refusal = session_calls_refusal(len(self.calls))
        if refusal is not None:
            await self._reply(ErrorReply(error=refusal), nonce)
            return
        # The wait runs as its own task: a consumer handles one message at a time, and a
        # session may call a remote it serves itself.
        task = asyncio.ensure_future(self._call(parsed, nonce))
        self.calls.add(task)
        task.add_done_callback(self.calls.discard)

    async def _call(self, parsed: RemoteCallBody, nonce: Nonce | None) -> None:
        assert self.user is not None
        try:
            result = await services.remote_call(
                user=self.user,
                remotename=parsed.remotename,
                function=parsed.function,
                args=parsed.args,
                timeout=None if parsed.timeout is None else float(parsed.timeout),
                caller_session=self.ws_session_id,
            )
        except services.RemoteError as exc:
            await self._reply(ErrorReply(error=exc.message), nonce)
        except asyncio.CancelledError:
            if not self.closing:
                await self._reply(ErrorReply(error="server shutting down"), nonce)
            raise
        except Exception:
            logger.exception("remote call %s.%s failed", parsed.remotename, parsed.function)
            await self._reply(ErrorReply(error="internal error"), nonce)
        else:
            # A dict display, not ``CallResultReply(result=…)``: calling the TypedDict costs
            # ~0.4 µs more, on every call (the display is cheaper than the old ``**fields``).
            answer: CallResultReply = {"result": result}
            await self._reply(answer, nonce)

    async def do_remote_call_result(self, parsed: RemoteCallResult, nonce: Nonce | None) -> None:
        request_id = parsed.request_id
        pending = self.pending.pop(request_id, None) if request_id is not None else None
        if pending is None:
            # Session-scoped fan-out (docs/ws-protocol.md#remote-call-result): only calls
            # pending on this session resolve, so the late answer a reconnected client sends
            # on its new socket for a call made on the old one is dropped here.
            logger.debug("ignoring remote-call-result for unknown requestId %r", request_id)
            return
        await self._answer(pending.reply_channel, parsed.reply())

    async def do_send_agent_prompt(self, parsed: SendAgentPromptBody, nonce: Nonce | None) -> None:
        """``send-agent-prompt`` (docs/ws-protocol.md#send-agent-prompt): a run for an
        expert agent (progress arrives as events), a message for a CLI agent; the reply
        names the run or the message."""
        accepted = await database_sync_to_async(agent_prompt_any)(
            user=self.user,
            agent_id=parsed.agent_id,
            instruction=parsed.instruction,
            input=parsed.input,
            options=parsed.options,
        )
        prompt_reply: AnyReply
        if accepted.message_id is not None:
            prompt_reply = PromptMessageReply(
                message="prompt accepted", agentId=accepted.agent_id, messageId=accepted.message_id
            )
        else:
            prompt_reply = PromptRunReply(message="prompt accepted", agentId=accepted.agent_id, runId=accepted.run_id)
        await self._reply(prompt_reply, nonce)

    # The action table (docs/ws-protocol.md#actions): action → its body's model, how the
    # frame becomes it, the handler above that gets it, and whether it is rate limited.
    # ``ping`` and ``remote-call-result`` never are: a busy remote must be able to answer as
    # fast as it is called (docs/ws-protocol.md#limits).
    ACTIONS: ClassVar[dict[str, Action[Any]]] = {
        "ping": Action(NoBody, any_body, do_ping, limited=False),
        "remote-connect": Action(RemoteConnectBody, remote_connect_body, do_remote_connect),
        "remote-disconnect": Action(RemoteNameBody, remote_name_body, do_remote_disconnect),
        "remote-list": Action(NoBody, any_body, do_remote_list),
        "remote-call": Action(RemoteCallBody, remote_call_body, do_remote_call),
        "remote-call-result": Action(RemoteCallResult, remote_call_result_body, do_remote_call_result, limited=False),
        "send-agent-prompt": Action(SendAgentPromptBody, send_agent_prompt_body, do_send_agent_prompt),
    }

    # --- channel-layer messages ------------------------------------------------------

    @receives(RemoteCallMessage)
    async def remote_call(self, call: RemoteCallMessage) -> None:
        """``remote.call`` (``RemoteCallMessage``): forward a call to this session's client as
        a downstream event."""
        served = self.served.get(call.remote_id)
        if served is None or self.closing:
            # Never forwarded: the caller may re-route it (its route was stale).
            refusal = RemoteCallReply(
                error=f"remote '{call.remotename}' disconnected", code="REMOTE_DISCONNECTED", delivered=False
            )
            await self._answer(call.reply_channel, refusal)
            return
        if not self.send_pressure.has_room():
            # Checked before the frame is built: a refusal must cost less than the call did.
            await self._refuse_busy(call)
            return
        request_id = new_request_id(served.name)
        frame = EncodedFrame(
            remote_call_event(request_id=request_id, remotename=call.remotename, function=call.function, args=call.args)
        )
        size = utf8_length(frame)
        if size > settings.WS_MAX_MESSAGE_BYTES:
            await self._answer(call.reply_channel, RemoteCallReply(error="arguments too large"))
            return
        if not self.send_pressure.has_room(size):
            await self._refuse_busy(call)
            return
        now = time.monotonic()
        self._expire_pending(now)
        self.pending[request_id] = PendingCall(
            remote_id=call.remote_id,
            remotename=call.remotename,
            reply_channel=call.reply_channel,
            expires_at=now + float(call.timeout or settings.REMOTE_CALL_TIMEOUT) + PENDING_GRACE,
        )
        await self._send(frame)

    async def _refuse_busy(self, call: RemoteCallMessage) -> None:
        """The client has not read what it was already sent (``core.backpressure``): the
        call is refused at once as ``REMOTE_BUSY`` rather than parked in this process's
        memory (docs/operating.md#bounds)."""
        busy = RemoteCallReply(error=f"remote '{call.remotename}' is busy", code="REMOTE_BUSY")
        await self._answer(call.reply_channel, busy)

    @receives(UserEventMessage)
    async def user_event(self, message: UserEventMessage) -> None:
        """``user.event`` (``UserEventMessage``): the user's live events; agent progress
        becomes event frames (docs/ws-protocol.md#agent-event)."""
        data = message.data
        frame: AgentEventFrame | RunFinishedFrame | None
        if message.event == "agent.event":
            frame = agent_event_frame(data)
        elif message.event == "run.updated":
            frame = run_finished_frame(data)
        else:
            frame = None
        if frame is None or self.closing:
            return
        if not self.send_pressure.has_room():
            # A doorbell, not the record: the run and its events are rows the client can
            # read once it reads again; meanwhile they do not pile up here.
            logger.info("dropping a %s frame: the client has not read %d bytes", message.event, self.unsent_bytes())
            return
        await self._send(frame)

    @receives(RemoteProbeMessage)
    async def remote_probe(self, probe: RemoteProbeMessage) -> None:
        """``remote.probe`` (``RemoteProbeMessage``): another session wants this remote's name;
        answer at once whether this session still serves it (no answer within 1 s makes it
        stale)."""
        serving = probe.remote_id in self.served and not self.closing
        await layer_send(probe.reply_channel, RemoteProbeReply(serving=serving))

    @receives(RemoteDisconnectedMessage)
    async def remote_disconnected(self, gone: RemoteDisconnectedMessage) -> None:
        """``remote.disconnected`` (``RemoteDisconnectedMessage``): a remote of this session was
        disconnected (maybe elsewhere)."""
        served = self.served.pop(gone.remote_id, None)
        if served is None:
            return
        for request_id, pending in list(self.pending.items()):
            if pending.remote_id == gone.remote_id:
                await self._fail_pending(request_id)
        if gone.remote_id in self.own_disconnects:
            self.own_disconnects.discard(gone.remote_id)
        elif not self.closing:
            # Another session (maybe in another process) disconnected it; tell the client.
            reason = gone.reason or "disconnected by another session of the user"
            await self._send(
                RemoteDisconnectedEvent(action="remote-disconnected", remotename=served.name, reason=reason)
            )

    @receives(ServerShutdownMessage)
    async def server_shutdown(self, message: ServerShutdownMessage) -> None:
        """``server.shutdown``: this process is stopping (or was reaped): fail calls, close."""
        for task in list(self.calls):
            task.cancel()
        await asyncio.gather(*self.calls, return_exceptions=True)
        self.closing = True
        for request_id in list(self.pending):
            await self._fail_pending(request_id)
        await self.close(code=CLOSE_SERVICE_RESTART)

    # --- helpers ------------------------------------------------------------------------

    async def _fail_refused_result(self, refused: dict[str, Any] | None, reason: str) -> bool:
        """A ``remote-call-result`` the strict parse refused (NaN, 1e400, an integer outside
        64 bits, a lone surrogate, nesting over the limit): when its ``requestId`` can still
        be read and is pending here, fail that call at once rather than let it time out."""
        if wire.lenient_field(refused, "action") != "remote-call-result":
            return False
        request_id = wire.lenient_field(refused, "requestId")
        pending = self.pending.pop(request_id, None) if isinstance(request_id, str) else None
        if pending is None:
            return False
        error = f"remote '{pending.remotename}' returned a result Dispatch cannot carry: {reason}"
        await self._answer(pending.reply_channel, RemoteCallReply(error=error))
        await self._send(ErrorReply(error=f"invalid JSON: {reason}"))
        return True

    async def _fail_pending(self, request_id: str) -> None:
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            await self._answer(
                pending.reply_channel, RemoteCallReply(error=f"remote '{pending.remotename}' disconnected")
            )

    def _expire_pending(self, now: float) -> None:
        for request_id in [rid for rid, call in self.pending.items() if call.expires_at < now]:
            del self.pending[request_id]

    async def _answer(self, reply_channel: str, reply: RemoteCallReply) -> None:
        try:
            await layer_send(reply_channel, reply)
        except ChannelFull:
            logger.warning("dropping a remote-call reply: caller channel full")
        except (TypeError, ValueError, RecursionError) as exc:
            # The layer could not serialise it (e.g. msgpack and a lone surrogate): the
            # caller must still get an answer rather than wait for its timeout.
            error = f"the remote's answer could not be relayed: {exc}"
            await layer_send(reply_channel, RemoteCallReply(error=error))

    async def _reply(self, frame: AnyReply, nonce: Nonce | None) -> None:
        """Send ``frame`` as the reply to a request that carried ``nonce`` (``frames.reply``)."""
        await self._send(reply(frame, nonce))
