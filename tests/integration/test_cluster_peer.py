"""Every outbox row is delivered once (docs/peers.md#the-outbox): a linked instance B that
reaches the cluster only through nginx keeps sending messages to a shadow of a cluster agent
while the cluster's ``serve`` process holding B's mirror stream is SIGKILLed in the middle
of one of B's signed message POSTs (docs/peers.md#messages).

The cluster (``tests.cluster``: nginx, three ``serve --no-background``, one
``dispatch_worker``, PostgreSQL + Redis) offers a pairing code; B (SQLite, one ``serve``
with its background services) links it by nginx's URL, so B's mirror stream
(``GET /api/v1/peers/events``) and its outbox drain (``POST /api/v1/peers/messages`` and
``…/batch``, each message under its own ``Idempotency-Key``) both go through nginx.

Which process holds what is read from the kernel's TCP table: nginx opens one upstream
connection per request (no upstream keep-alive), so a ``serve`` port's established
connections are its open streams plus the requests in flight. B's stream is the only one
at rest; two ``/api/v1/events`` streams of this test then sit on the two other processes,
so nginx's ``least_conn`` spreads B's POSTs over all three. While B sends, the holder of
B's stream is SIGKILLed the moment it has a second connection (a POST of B in flight):
that POST fails (nginx answers 502) and B's stream drops; B reconnects through nginx to a
survivor, which resets its outbox backoff, and the drain sends the rows again under the
same keys (a message the killed process had committed is answered "duplicate").

Then every one of B's rows must end ``delivered``, and on the cluster each message must
be exactly one ``AgentMessage`` of the agent (one receipt per key, every key of B's once),
pasted into the agent's pane exactly once. The test prints a one-line JSON summary and
starts the killed process again, leaving the topology whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.backends import free_port
from tests.cluster import Cluster, cluster, unique
from tests.infra import PYTHON, REPO, Instance, Process, Server, instance, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

AGENT_TYPES = json.dumps({"shell": {"argv": ["bash", "--norc", "-i"], "kind": "shell"}})
MESSAGES = 40  # at least this many messages are sent
ARM_AT = 8  # the kill waits for a POST in flight once this many messages were sent ...
AFTER_KILL = 10  # ... and this many more are sent after it
MAX_MESSAGES = 120  # no POST of B caught on the holder by then: killed anyway, the test fails
SPACING = 0.1  # seconds between two messages
TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def _kill_tmux(socket_name: str) -> None:
    subprocess.run(["tmux", "-L", socket_name, "kill-server"], capture_output=True, check=False)
    (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / socket_name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def topo() -> Iterator[Cluster]:
    tmux_socket = unique("dispatch-cpeer-")
    try:
        with cluster(
            servers=3,
            tls=False,
            # Shell agents only, in a private tmux server (as tests.cluster.shared_cluster).
            DISPATCH_AGENT_TYPES=AGENT_TYPES,
            DISPATCH_TMUX_SOCKET=tmux_socket,
            DISPATCH_CLI_SUPERVISE_INTERVAL="0.3",
            DISPATCH_PEER_BACKOFF_SCALE="0.05",
        ) as topo:
            yield topo
    finally:
        _kill_tmux(tmux_socket)


@pytest.fixture
def b_tmux_socket() -> Iterator[str]:
    name = unique("dispatch-cpeer-b-")
    try:
        yield name
    finally:
        _kill_tmux(name)


def serve_at(inst: Instance, port: int) -> Server:
    """``manage.py serve`` of ``inst`` on a fixed ``port`` (its public URL), waited healthy."""
    started = Process.spawn(inst.env, [PYTHON, str(REPO / "manage.py"), "serve", "--port", str(port)], name="peer")
    server = Server(proc=started.proc, log_path=started.log_path, port=port)
    inst.servers.append(server)
    return server.wait_healthy(60)


class Api:
    """A user's REST client of one URL (a server or nginx)."""

    def __init__(self, url: str, token: str) -> None:
        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def get(self, path: str) -> Any:
        response = self.client.get(path)
        assert response.status_code == 200, f"GET {path}: {response.status_code} {response.text}"
        return response.json()

    def post(self, path: str, body: dict[str, Any], status: int = 201) -> Any:
        response = self.client.post(path, json=body)
        assert response.status_code == status, f"POST {path}: {response.status_code} {response.text}"
        return response.json()


def established(ports: list[int]) -> dict[int, int]:
    """How many established TCP connections were accepted on each of ``ports`` (the
    kernel's table: the server side of each connection has the port as its local one)."""
    counts = dict.fromkeys(ports, 0)
    for table in TCP_TABLES:
        try:
            with open(table) as handle:
                lines = handle.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "01":
                port = int(fields[1].rsplit(":", 1)[1], 16)
                if port in counts:
                    counts[port] += 1
    return counts


class EventsStream:
    """A raw ``GET /api/v1/events`` through nginx, read and discarded by a thread, so it
    holds one upstream connection of whichever process nginx gave it to."""

    def __init__(self, topo: Cluster) -> None:
        self.sock = socket.create_connection(("127.0.0.1", topo.front.port), timeout=10)
        request = (
            f"GET /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1:{topo.front.port}\r\n"
            f"Authorization: Bearer {topo.token}\r\nAccept: text/event-stream\r\n\r\n"
        )
        self.sock.sendall(request.encode())
        self.head = b""
        self.sock.settimeout(None)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(65536):
                if len(self.head) < 64:
                    self.head += chunk[:64]
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)


@dataclass
class Run:
    """What the sender and the killer share."""

    sent: list[dict[str, Any]] = field(default_factory=list)
    contents: list[str] = field(default_factory=list)
    done_sending: bool = False
    killed_at: float = 0.0  # time.monotonic()
    killed_after: int = -1  # messages sent when the kill happened
    in_flight: bool = False  # the holder had a connection besides B's stream when killed
    kill_counts: dict[int, int] = field(default_factory=dict)


def nginx_peer_posts(topo: Cluster, offset: int) -> Counter[str]:
    """Status codes of the peer message POSTs in nginx's access log after ``offset`` bytes."""
    path = topo.nginx.prefix / "access.log"
    text = path.read_bytes()[offset:].decode(errors="replace") if path.exists() else ""
    return Counter(
        found.group(1) for found in re.finditer(r'"POST /api/v1/peers/messages(?:/batch)? HTTP/[\d.]+" (\d{3})', text)
    )


def pane_text(socket_name: str, session: str) -> str:
    done = subprocess.run(
        ["tmux", "-L", socket_name, "capture-pane", "-p", "-J", "-S", "-", "-t", f"={session}:"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout


def outbox_rows(db_path: Path, message_ids: list[int]) -> dict[int, tuple[str, str, int]]:
    """B's outbox rows of ``message_ids``: message id → (status, idempotency key, attempts)."""
    with closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)) as conn:
        marks = ",".join("?" * len(message_ids))
        query = "SELECT message_id, status, idempotency_key, attempts FROM peers_outboxmessage WHERE message_id IN "
        rows = conn.execute(f"{query}({marks})", message_ids).fetchall()
    return {int(row[0]): (str(row[1]), str(row[2]), int(row[3])) for row in rows}


def test_every_outbox_row_is_delivered_once_across_a_sigkill_behind_nginx(
    topo: Cluster, tmp_path: Path, b_tmux_socket: str
) -> None:
    if not Path(TCP_TABLES[0]).exists():
        pytest.skip("needs Linux's /proc/net/tcp to see which process holds which connection")
    started = time.monotonic()
    (tmp_path / "repo").mkdir()
    tag = f"pk{uuid.uuid4().hex[:6]}"
    port_b = free_port()
    ports = [server.port for server in topo.servers]
    try:
        scenario(topo, tmp_path, b_tmux_socket, started, tag, ports, port_b)
    finally:
        # Leave the topology whole for whatever runs next.
        for index, server in enumerate(topo.servers):
            if not server.running:
                topo.restart(index, timeout=90)


def scenario(
    topo: Cluster, tmp_path: Path, b_tmux_socket: str, started: float, tag: str, ports: list[int], port_b: int
) -> None:
    repo = tmp_path / "repo"
    with (
        ExitStack() as stack,
        instance(
            DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port_b}",
            DISPATCH_TMUX_SOCKET=b_tmux_socket,
            DISPATCH_CLI_SUPERVISE_INTERVAL="0.3",
            DISPATCH_PEER_BACKOFF_SCALE="0.05",
        ) as b,
    ):
        assert "DATABASE_URL" not in b.env  # B: SQLite and the in-memory channel layer
        server_b = serve_at(b, port_b)

        def details() -> str:
            return f"{topo.details()}\n--- B ({server_b.pid})\n{server_b.log()[-4000:]}"

        # Pair: the cluster offers, B links through nginx (B's peer url is nginx's).
        offer = topo.instance.manage("peer_offer").stdout
        code = re.search(r"code: (\S+)", offer)
        assert code is not None, offer
        linked = b.manage("peer_link", topo.url, code.group(1), "--label", "Cluster").stdout
        assert "linked: Cluster" in linked, linked
        api_c, api_b = Api(topo.url, topo.token), Api(server_b.url, b.admin_token)
        (peer,) = api_b.get("/api/v1/peers")["peers"]
        assert peer["url"].rstrip("/") == topo.url, peer

        # A shell agent on the cluster; B mirrors it as a running shadow.
        agent = api_c.post(
            "/api/v1/agents", {"type": "shell", "name": "target", "cwd": str(repo), "prompt": f"echo {tag}-ready"}
        )
        wait_until(
            lambda: api_c.get(f"/api/v1/agents/{agent['id']}")["status"] == "running",
            timeout=60,
            what="the cluster's shell agent running",
            details=details,
        )

        def shadow_of_agent() -> dict[str, Any] | None:
            for candidate in api_b.get("/api/v1/agents")["agents"]:
                if candidate.get("peer_agent_id") == agent["id"] and candidate.get("peer") == "Cluster":
                    if candidate["status"] == "running" and not candidate.get("stale"):
                        return dict(candidate)
            return None

        shadow = wait_until(shadow_of_agent, timeout=60, interval=0.2, what="B's shadow of the agent", details=details)

        # At rest the only upstream connection is B's stream: its holder.
        def stream_holder() -> int | None:
            counts = established(ports)
            if sorted(counts.values()) == [0, 0, 1]:
                return ports.index(next(port for port, count in counts.items() if count == 1))
            return None

        holder = wait_until(
            stream_holder,
            timeout=30,
            interval=0.2,
            what=f"B's stream as the one upstream connection (now {established(ports)})",
            details=details,
        )
        # One /api/v1/events stream on each other process: least_conn now spreads B's POSTs over all three.
        streams = [EventsStream(topo) for _ in range(2)]
        for stream in streams:
            stack.callback(stream.close)
        wait_until(
            lambda: (
                sorted(established(ports).values()) == [1, 1, 1]
                and all(stream.head.startswith(b"HTTP/1.1 200") for stream in streams)
            ),
            timeout=15,
            interval=0.05,
            what="one stream on each process",
            details=lambda: f"{established(ports)} {[stream.head for stream in streams]}\n{details()}",
        )
        holder_port = ports[holder]
        log_offset = (topo.nginx.prefix / "access.log").stat().st_size

        run = Run()

        def killer() -> None:
            while len(run.sent) < ARM_AT and not run.done_sending:
                time.sleep(0.005)
            while not run.done_sending:
                counts = established(ports)
                if counts[holder_port] >= 2:  # B's stream and a request in flight
                    run.in_flight = True
                    run.kill_counts = counts
                    break
                time.sleep(0.001)
            run.killed_after = len(run.sent)
            topo.servers[holder].kill()
            run.killed_at = time.monotonic()

        kill_thread = threading.Thread(target=killer, daemon=True)
        kill_thread.start()
        sending_from = time.monotonic()
        try:
            for n in range(MAX_MESSAGES):
                if n >= MESSAGES and run.killed_at and n >= run.killed_after + AFTER_KILL:
                    break
                content = f"echo {tag}-$((1000+{n}))"
                sent = api_b.post(f"/api/v1/agents/{shadow['id']}/messages", {"content": content})
                assert sent["status"] in ("queued", "delivered"), sent
                run.contents.append(content)
                run.sent.append(sent)
                time.sleep(SPACING)
        finally:
            run.done_sending = True
        last_sent_at = time.monotonic()
        kill_thread.join(30)
        assert run.killed_at, "the killer never killed"
        total = len(run.sent)
        message_ids = [int(message["id"]) for message in run.sent]
        db_b = Path(b.env["DISPATCH_DATA_DIR"]) / "dispatch.sqlite3"

        # Every one of B's rows ends delivered (a dead one fails at once).
        def all_delivered() -> bool:
            rows = outbox_rows(db_b, message_ids)
            dead = {mid: row for mid, row in rows.items() if row[0] != "queued" and row[0] != "delivered"}
            assert not dead, f"outbox rows settled other than delivered: {dead}\n{details()}"
            return len(rows) == total and all(row[0] == "delivered" for row in rows.values())

        wait_until(all_delivered, timeout=150, interval=0.2, what="every outbox row of B delivered", details=details)
        delivered_at = time.monotonic()
        for message in run.sent:
            assert api_b.get(f"/api/v1/messages/{message['id']}")["status"] == "delivered"
        keys = {mid: row[1] for mid, row in outbox_rows(db_b, message_ids).items()}
        assert len(set(keys.values())) == total

        # On the cluster: each message once, under its own key, pasted into the pane once.
        session = f"dispatch_{agent['id']}"
        outputs = {content: f"{tag}-{1000 + n}" for n, content in enumerate(run.contents)}

        def pasted_once() -> bool:
            text = pane_text(topo.env["DISPATCH_TMUX_SOCKET"], session)
            seen = {out: len(re.findall(rf"(?<![\w-]){re.escape(out)}(?!\d)", text)) for out in outputs.values()}
            assert max(seen.values()) <= 1, f"pasted twice: {[o for o, c in seen.items() if c > 1]}"
            return min(seen.values()) == 1

        def cluster_messages() -> list[tuple[Any, ...]]:
            return topo.rows(
                "SELECT content, idempotency_key, status FROM dispatch_agentmessage"
                " WHERE recipient_agent_id = %s AND sender_peer_id IS NOT NULL",
                agent["id"],
            )

        wait_until(
            lambda: all(row[2] == "delivered" for row in cluster_messages()),
            timeout=60,
            interval=0.2,
            what="the cluster's messages pasted by its supervisor",
            details=details,
        )
        wait_until(pasted_once, timeout=30, interval=0.2, what="every message's output in the pane", details=details)
        time.sleep(1.5)  # a late drain pass or a replay must add nothing

        rows = cluster_messages()
        by_content = Counter(row[0] for row in rows)
        lost = [content for content in run.contents if by_content[content] == 0]
        twice = {content: count for content, count in by_content.items() if count > 1}
        extra = [content for content in by_content if content not in outputs]
        assert not lost and not twice and not extra, f"lost {lost}, duplicated {twice}, unexpected {extra}"
        assert len(rows) == total
        by_key = Counter(row[1] for row in rows)
        assert set(by_key) == set(keys.values()) and max(by_key.values()) == 1, by_key
        receipts = topo.rows("SELECT idempotency_key, response_status FROM peers_peerreceipt WHERE route = 'messages'")
        receipt_keys = Counter(key for key, _ in receipts)
        assert {key: receipt_keys[key] for key in keys.values()} == dict.fromkeys(keys.values(), 1), receipts
        assert all(status == 200 for key, status in receipts if key in by_key), receipts
        assert pasted_once()

        posts = nginx_peer_posts(topo, log_offset)
        events = api_b.get(f"/api/v1/agents/{shadow['id']}/events")["events"]
        summary = {
            "messages": total,
            "killed_server": holder,
            "killed_after_message": run.killed_after,
            "post_in_flight_at_kill": run.in_flight,
            "connections_at_kill": {str(port): count for port, count in run.kill_counts.items()},
            "peer_message_posts": dict(posts),
            "failed_posts_retried": sum(count for status, count in posts.items() if status != "200"),
            "b_lost_contact_events": [e["message"] for e in events].count("lost contact with Cluster"),
            "seconds_sending_to_kill": round(run.killed_at - sending_from, 2),
            "seconds_kill_to_all_delivered": round(delivered_at - run.killed_at, 2),
            "seconds_last_send_to_all_delivered": round(delivered_at - last_sent_at, 2),
            "seconds_total": round(time.monotonic() - started, 1),
        }
        print(f"\ncluster-peer summary: {json.dumps(summary)}")
        assert run.in_flight, f"no POST of B was in flight on the stream's holder when it was killed: {summary}"
        stack.close()
