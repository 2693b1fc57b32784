"""Two ``dispatch_worker`` processes on PostgreSQL + Redis: SIGKILL the one holding the
host's CLI supervisor lease; the other takes it over within the lease time and every queued
message reaches the agent's pane exactly once (one supervisor per host under a lease:
docs/deployment.md#what-runs-where).

The leases a worker can hold: the CLI supervisor lease of its host (``SupervisorLease``,
``3 × DISPATCH_CLI_SUPERVISE_INTERVAL``, renewed every pass), a peer's drain lease
(``PeerLease`` kind ``drain``, 60 s, held only during a drain pass and released at its
end) and a peer's subscribe lease (``subscribe``, 180 s, for the mirror's stream). This
test covers the supervisor lease, the one held all the time; the peer leases need a
linked instance and outlast this test's budget.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.infra import Instance, Process, instance, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(150),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

SUPERVISE_INTERVAL = 0.5
LEASE_TTL = 3 * SUPERVISE_INTERVAL  # agents.supervisor.LEASE_INTERVALS × the interval
MESSAGES = 16
KILL_AFTER = 5  # messages queued before the holder is killed


@pytest.fixture
def tmux_socket() -> Iterator[str]:
    socket = f"dispatch-failover-{uuid.uuid4().hex[:8]}"
    try:
        yield socket
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, check=False)
        (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / socket).unlink(missing_ok=True)


def lease_holder(inst: Instance) -> str | None:
    with psycopg.connect(inst.env["DATABASE_URL"], autocommit=True) as conn:
        row = conn.execute("SELECT holder, expires_at > now() FROM dispatch_supervisorlease").fetchone()
    return None if row is None or not row[1] else str(row[0])


def process_id_of(worker: Process) -> str:
    for line in worker.log().splitlines():
        if "Dispatch worker running (process " in line:
            return line.split("(process ", 1)[1].rstrip(")").strip()
    raise AssertionError(worker.log())


def pane_text(socket: str, session: str) -> str:
    done = subprocess.run(
        ["tmux", "-L", socket, "capture-pane", "-p", "-J", "-S", "-", "-t", session],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout


def test_the_other_worker_takes_the_supervisor_lease_over_and_delivers_each_message_once(
    tmp_path: Path, tmux_socket: str
) -> None:
    with instance(
        postgres=True,
        redis=True,
        DISPATCH_CLI_SUPERVISE_INTERVAL=SUPERVISE_INTERVAL,
        DISPATCH_TMUX_SOCKET=tmux_socket,
        DISPATCH_REPO_ROOTS=str(tmp_path),
    ) as inst:
        api_server = inst.serve("--no-background")  # the API only: the workers supervise
        workers = [inst.worker(), inst.worker()]
        ids = {process_id_of(worker): worker for worker in workers}
        api = httpx.Client(base_url=api_server.url, headers={"Authorization": f"Bearer {inst.admin_token}"}, timeout=30)
        created = api.post(
            "/api/v1/agents", json={"type": "shell", "name": "failover", "cwd": str(tmp_path), "prompt": "echo ready"}
        )
        assert created.status_code == 201, created.text
        agent = created.json()
        session = f"dispatch_{agent['id']}"
        wait_until(
            lambda: api.get(f"/api/v1/agents/{agent['id']}").json()["status"] == "running",
            timeout=30,
            what="the shell agent running",
        )
        holder = wait_until(lambda: lease_holder(inst), timeout=10, what="a supervisor lease holder")
        assert holder in ids, (holder, ids)
        survivor_id = next(process_id for process_id in ids if process_id != holder)

        sent: list[dict[str, Any]] = []
        killed_at: list[float] = []
        failures: list[str] = []

        def send_messages() -> None:
            for number in range(MESSAGES):
                if number == KILL_AFTER:
                    ids[holder].kill()  # SIGKILL: its lease stays until it expires
                    killed_at.append(time.monotonic())
                response = api.post(
                    f"/api/v1/agents/{agent['id']}/messages", json={"content": f"echo mark-{number}-$((1+1))"}
                )
                if response.status_code != 201:
                    failures.append(f"{number}: {response.status_code} {response.text}")
                else:
                    sent.append(response.json())
                time.sleep(0.15)

        sender = threading.Thread(target=send_messages)
        sender.start()
        wait_until(lambda: killed_at, timeout=30, what="the holder killed")
        wait_until(lambda: lease_holder(inst) == survivor_id, timeout=LEASE_TTL + 10, interval=0.05, what="takeover")
        takeover_after = time.monotonic() - killed_at[0]
        sender.join(30)
        assert failures == []

        def all_delivered() -> bool:
            return all(api.get(f"/api/v1/messages/{m['id']}").json()["status"] == "delivered" for m in sent)

        wait_until(all_delivered, timeout=30, what="every message delivered")
        wait_until(
            lambda: f"mark-{MESSAGES - 1}-2" in pane_text(tmux_socket, session), timeout=10, what="the last output"
        )
        time.sleep(2 * SUPERVISE_INTERVAL)  # a later pass must not paste anything again
        pane = pane_text(tmux_socket, session)
        outputs = {number: pane.count(f"\nmark-{number}-2") for number in range(MESSAGES)}
        summary = {
            "killed_holder": holder,
            "survivor": survivor_id,
            "lease_ttl_s": LEASE_TTL,
            "takeover_after_kill_s": round(takeover_after, 2),
            "messages": MESSAGES,
            "outputs_per_message": outputs,
        }
        (tmp_path / "worker_failover.json").write_text(json.dumps(summary))
        print("worker failover:", json.dumps(summary))
        assert takeover_after <= LEASE_TTL + 2 * SUPERVISE_INTERVAL + 1.0, summary  # expiry + a pass, 1 s slack
        assert set(outputs.values()) == {1}, summary
        assert workers[[*ids].index(survivor_id)].running
