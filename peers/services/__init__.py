"""Every write of the peers app (docs/architecture.md#the-layers), one module per concern.

- ``pairing``: making and ending links — offers and their codes, the ``Peer`` row a claim
  or its answer stores, revocation (docs/peers.md#pairing, docs/peers.md#unlinking);
- ``links``: a link once made — label and capability rules, renaming, capability changes,
  the admin's edit, credential rotation, liveness (``last_seen_at``) and what a reconnect
  sets going;
- ``incoming``: what a linked peer asks of this instance through the peer API (docs/peers.md#the-peer-api):
  launches, messages, stops and archives, its capabilities and the repo roots;
- ``outgoing``: messages this instance sends to a peer's agents, with their outbox row;
- ``outbox``: the outbox rows — queueing, each try's outcome, retry, discard, retention (docs/peers.md#the-outbox);
- ``shadows``: the local rows mirroring a peer's agents (docs/peers.md#shadow-agents);
- ``receipts``: the ``Idempotency-Key`` receipts of the peer API (docs/peers.md#authentication);
- ``leases``: per-peer leases of background work, ``drain`` and ``subscribe``;
- ``identity``: this instance's key pair and display name, and who may change them.

Callers import the submodule (``from peers.services import shadows``); nothing is
re-exported here. No module outside this package writes (``tests/peers/
test_writes_in_services.py``). Nothing here imports the peer client, the HTTP exchanges or
the loops (``peers.client``, ``peers.pairing_exchange``, ``peers.remote_launch``, ``peers.outbox_drain``,
``peers.mirror``): they sit above and call these. Where a write is followed by an HTTP call
— telling a peer it was unlinked — the caller passes it in (``on_revoked``) and it runs
after commit.
"""
