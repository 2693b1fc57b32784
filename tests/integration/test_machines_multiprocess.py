"""Machines across two ``manage.py serve`` processes sharing PostgreSQL and Redis
(docs/shim-protocol.md#presence-and-takeover, docs/deployment.md#what-runs-where).

A shim's socket lives in one process; an operation may be requested on any. The default
machine and the round-robin counter are shared (the database and Redis), and a caller
waiting on a shim whose process dies gets ``MACHINE_UNREACHABLE`` within seconds (the
instance runs with ``DISPATCH_PROCESS_TTL=3`` and liveness checks every 0.5 s,
``tests.infra.base_env``).
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.infra import Instance, Server, ShimProcess, instance, wait_until
from tests.live_clients import InFlight, MachineApi, api_error, kill_quietly, wait_for_child

pytestmark = [
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(90),
]


@dataclass
class Pair:
    """Servers ``a`` and ``b`` of one instance; ``api_a``/``api_b`` talk to each as ``admin``."""

    instance: Instance
    a: Server
    b: Server
    api_a: MachineApi
    api_b: MachineApi
    tmp_path: Path
    session: str = field(default_factory=lambda: f"mp-{uuid.uuid4().hex[:10]}")
    shims: list[ShimProcess] = field(default_factory=list)

    def shim(self, name: str, server: Server, *flags: str) -> ShimProcess:
        """A shim named ``name`` connected to ``server``, attached to this test's session."""
        root = self.tmp_path / f"root-{name}"
        root.mkdir(exist_ok=True)
        shim = self.instance.shim(
            name, root, "--session", self.session, *flags, server=server, state_dir=self.tmp_path / f"state-{name}"
        )
        self.shims.append(shim)
        return shim


@contextlib.contextmanager
def two_servers(tmp_path: Path) -> Iterator[Pair]:
    with instance(postgres=True, redis=True) as inst:
        a, b = inst.serve(wait=False), inst.serve(wait=False)  # both start at once
        a.wait_healthy(), b.wait_healthy()
        token = inst.token("admin")
        pair = Pair(
            instance=inst, a=a, b=b, api_a=MachineApi(a.url, token), api_b=MachineApi(b.url, token), tmp_path=tmp_path
        )
        try:
            yield pair
        finally:
            pair.api_a.client.close()
            pair.api_b.client.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with two_servers(tmp_path_factory.mktemp("machines-mp")) as pair:
        yield pair


@pytest.fixture
def pair(shared: Pair, tmp_path: Path) -> Iterator[Pair]:
    """The shared servers, with a session and a temporary directory of the test's own."""
    shared.session, shared.tmp_path, shared.shims = f"mp-{uuid.uuid4().hex[:10]}", tmp_path, []
    try:
        yield shared
    finally:
        for shim in shared.shims:
            shim.stop()
        shared.api_a.set_default(None)
        for server in (shared.a, shared.b):
            assert server.running, server.log()


def test_an_operation_requested_on_one_process_runs_on_a_shim_held_by_the_other(pair: Pair) -> None:
    shim = pair.shim("held-by-a", pair.a)
    answer = pair.api_b.run(pair.session, ["sh", "-c", "echo $PPID"])
    assert answer["machine_id"] == shim.machine_id
    assert answer["payload"]["stdout"].strip() == str(shim.pid)
    assert list(pair.api_b.machines(pair.session)) == [shim.machine_id]

    written = pair.api_b.ok(
        pair.session, "FILE_WRITE", {"path": str(pair.tmp_path / "root-held-by-a" / "x.txt"), "content": "via b"}
    )
    assert written["machine_id"] == shim.machine_id
    assert (pair.tmp_path / "root-held-by-a" / "x.txt").read_text() == "via b"


def test_the_default_machine_set_through_one_process_is_used_by_the_other(pair: Pair) -> None:
    alpha, beta = pair.shim("alpha", pair.a), pair.shim("beta", pair.b)
    assert pair.api_a.run(pair.session, ["true"])  # A has looked the (unset) default up once
    assert pair.api_b.set_default(beta.machine_id).status_code == 200
    assert pair.api_a.machines(pair.session)[beta.machine_id]["is_default"] is True
    for _ in range(4):
        assert pair.api_a.run(pair.session, ["true"])["machine_id"] == beta.machine_id

    assert pair.api_b.set_default(alpha.machine_id).status_code == 200
    for _ in range(4):
        assert pair.api_a.run(pair.session, ["true"])["machine_id"] == alpha.machine_id


def test_machines_take_turns_whichever_process_receives_the_operations(pair: Pair) -> None:
    alpha, beta = pair.shim("alpha", pair.a), pair.shim("beta", pair.b)
    names = {alpha.machine_id: "alpha", beta.machine_id: "beta"}
    served = []
    for api in (pair.api_a, pair.api_b, pair.api_b, pair.api_a, pair.api_a, pair.api_b, pair.api_a, pair.api_b):
        served.append(names[api.run(pair.session, ["true"])["machine_id"]])
    # One counter for both processes: strictly alternating (two counters would repeat a machine).
    assert all(one != two for one, two in itertools.pairwise(served)), served


def test_a_caller_waiting_on_a_shim_whose_process_dies_fails_within_seconds(tmp_path: Path) -> None:
    with two_servers(tmp_path) as pair:
        shim = pair.shim("on-a", pair.a)
        pending = InFlight(
            pair.api_b, pair.session, "EXECUTE_COMMAND", {"argv": ["sleep", "30"], "timeout_seconds": 60}
        )
        sleeper = wait_for_child(shim.pid, "sleep")
        try:
            killed_at = time.monotonic()
            pair.a.kill()
            response = pending.result(timeout=15)
            waited = pending.answered_at - killed_at
            assert response.status_code == 502, response.text
            assert api_error(response)["code"] == "MACHINE_UNREACHABLE"
            assert waited < 6, f"the caller waited {waited:.1f}s (process TTL 3 s, liveness checks every 0.5 s)"
        finally:
            kill_quietly(sleeper)
        # Nothing left attached on B once the dead process is reaped.
        wait_until(
            lambda: pair.api_b.machines(pair.session) == {},
            timeout=15,
            what="the dead process's machine to be reaped",
            details=pair.b.log,
        )
        response = pair.api_b.op(pair.session, "EXECUTE_COMMAND", {"argv": ["true"]})
        assert (response.status_code, api_error(response)["code"]) == (404, "MACHINE_NOT_ATTACHED")
