"""The channel layer, one way for each job (docs/architecture.md#how-the-code-is-written).

The layer is a doorbell, never the only copy of anything (the rows are the truth), and
this package is the only code that sends on it, calls ``group_send`` or ``receive``.
Every message is a typed model (``core.protocol.ChannelMessage``; each app's own in its
``protocol.py``): the functions here take the model, never a dict, and turn it into the
plain dict the layer carries (``ChannelMessage.for_layer``) right before sending; what
arrives is validated with its model, and a message that does not fit is logged and
dropped (``message_received``), never raised into a loop or a consumer.

- **Rings after commit** — ``ring_on_commit(group, message)`` sends ``message`` to
  ``group`` once the current transaction commits (at once outside one), ``send_on_commit``
  to one channel; ``ring`` sends to a group from async code. A ring that fails (a full
  channel, Redis down) is logged, never raised: the change has happened, and whoever
  listens polls anyway. Each doorbell's group name lives in the module that owns it
  (``core.revocation.DOORBELL_GROUP``, ``core.tool_changes.tools_group``,
  ``agents.messages.doorbell_group``, ``agents.services.user_events_group``,
  ``peers.services.outbox.DOORBELL_GROUP``); the one a lower module rings for a higher one is here
  (``PEERS_MIRROR_GROUP``: pairing rings the mirroring loop).
- **Sending now** — ``layer_send(channel, message)``, from async code, raising what the
  layer raises (``ChannelFull``; a message it cannot serialize): a consumer's answer on a
  reply channel, a takeover, a shutdown, a revocation.
- **Listening** — a ``Subscription`` is one channel of this process in some groups, read
  by **one long-lived receive task** that hands each message to ``wait(timeout)``. A
  channel-layer ``receive`` is never cancelled while the channel lives: channels-redis
  drops the messages buffered for a channel whose receive is cancelled, and its pub/sub
  layer unsubscribes the channel. The only cancel is ``close()``, at the end of the
  channel's life. A background loop's doorbell (with a ``LoopHealth``) survives layer
  outages: the receiver reports them, backs off and joins its groups again, while the
  loop's ``wait`` just times out — the loop's periodic pass is the guarantee. An event
  stream's subscription (no ``LoopHealth``) ends instead: ``wait`` raises the layer's
  error and the client reconnects to a fresh snapshot.
- **Request/reply** — ``request_reply`` sends a request (a ``ChannelRequest``) carrying a
  fresh ``reply_channel`` and waits, bounded, for the one answer, validated as the
  caller's reply model (the consumer answers with ``layer_send(reply_channel, <reply>)``),
  re-checking the answerer's liveness while it waits; used by remote calls
  (docs/ws-protocol.md#remote-call) and machine operations (docs/shim-protocol.md#operations).
  ``layer_request`` is its short form for probes (is a name's holder still there?), ``layer_round_trip``
  the ``/healthz`` check of the layer.
- **Same process** — a message to a consumer of this process skips the layer: each
  consumer's channel has a ``LocalChannel`` inbox beside it (``consumer_channel``);
  ``request_reply`` (from the consumer's event loop), ``layer_send`` and
  ``send_on_commit`` put their message there, and a same-process ``request_reply`` waits
  on a local reply inbox, which ``layer_send`` fills. Same capacity (``ChannelFull``:
  busy), same serialization refusals, each message the receiver's own dict, one path so
  one sender's messages keep their order; a consumer that ends closes its inbox and what
  waited there is dropped, as on a dead channel (docs/operating.md#channel-layer).
  Groups and ``layer_round_trip`` (a ``Subscription``, not a consumer) stay on the layer.
- ``LoopHealth``: how a background loop is doing — its backoff after errors and its
  once-per-change-of-state log (docs/operating.md#health).

Its modules, one concern each (importers take every name from ``core.realtime``):
``loop_health`` (``LoopHealth``), ``received`` (``message_received``), ``local`` (the
same-process fast path: ``LocalChannel``, ``consumer_channel``), ``rings`` (``ring``,
``ring_on_commit``, ``send_on_commit``, ``layer_send``), ``subscription``
(``Subscription``), ``replies`` (``request_reply``, ``layer_request``,
``layer_round_trip``). They log as ``core.realtime``.
"""

from core.realtime.local import LOCAL_REPLY_PREFIX, LocalChannel, consumer_channel, local_inbox
from core.realtime.loop_health import BACKOFF_JITTER, LoopHealth
from core.realtime.received import message_received
from core.realtime.replies import Gone, layer_request, layer_round_trip, request_reply
from core.realtime.rings import (
    PEERS_MIRROR_GROUP,
    RING_QUEUE_LIMIT,
    layer_send,
    ring,
    ring_on_commit,
    send_on_commit,
)
from core.realtime.subscription import LEAVE_TIMEOUT, Subscription

__all__ = [
    "BACKOFF_JITTER",
    "LEAVE_TIMEOUT",
    "LOCAL_REPLY_PREFIX",
    "PEERS_MIRROR_GROUP",
    "RING_QUEUE_LIMIT",
    "Gone",
    "LocalChannel",
    "LoopHealth",
    "Subscription",
    "consumer_channel",
    "layer_request",
    "layer_round_trip",
    "layer_send",
    "local_inbox",
    "message_received",
    "request_reply",
    "ring",
    "ring_on_commit",
    "send_on_commit",
]
