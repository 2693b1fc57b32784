"""Every write of the peers app (CONVENTIONS.md "services"), one module per concern.

- ``incoming``: what a linked peer asks of this instance through the peer API (spec/peers.md
  §5): launches, messages, stops and archives, its capabilities and the repo roots;
- ``shadows``: the local rows mirroring a peer's agents (§6-7);
- ``receipts``: the ``Idempotency-Key`` receipts of the peer API (§4, §5);
- ``leases``: per-peer leases of background work (§7, §8);
- ``links``: a link's liveness (``last_seen_at``, §4);
- ``identity``: this instance's key pair (§1).

Callers import the submodule (``from peers.services import shadows``); nothing is
re-exported here. The writes of pairing (``peers.pairing``), the outbox (``peers.outbox``)
and the mirroring subscriber (``peers.mirror``) are still in those modules, and so is
``peers.remote_launch.peer_message_send`` (its outbox row is ``peers.outbox``'s). Nothing
here imports the peer client or the loops: they sit above.
"""
