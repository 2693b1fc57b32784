"""Which machine serves an operation (docs/shim-protocol.md#routing)."""

from __future__ import annotations

import collections
import itertools
from typing import Any

import pytest
from django.test import AsyncClient

from machines.services.errors import MachineError
from machines.services.operations import machine_op

pytestmark = pytest.mark.django_db(transaction=True)

ALICE_ID = "3f2b9c1e-aaaa-4000-8000-000000000001"
ALICE_SERVER_ID = "3f2b9c1e-bbbb-4000-8000-000000000002"


async def run(user: Any, op: str, payload: dict[str, Any], *, session: str = "s1", target: str | None = None) -> str:
    """Route one operation; return the machine_id that served it."""
    response = await machine_op(
        user=user, session_id=session, op=op, payload=payload, target_machine=target, caller="test"
    )
    return str(response["machine_id"])


async def refusal(user: Any, op: str, payload: dict[str, Any], **kwargs: Any) -> MachineError:
    with pytest.raises(MachineError) as failure:
        await run(user, op, payload, **kwargs)
    return failure.value


STAT = ("FILE_STAT", {"path": "/home/alice/notes.txt"})
COMMAND = ("EXECUTE_COMMAND", {"argv": ["true"]})


@pytest.fixture
async def two_machines(shims, owner):
    laptop = await shims.connect(owner, machine_id=ALICE_ID, hostname="Laptop.local", display_name="Alice's Laptop")
    server = await shims.connect(owner, machine_id=ALICE_SERVER_ID, hostname="build-server", allowed_roots=["/srv"])
    return laptop, server


async def test_with_one_machine_every_operation_goes_to_it(shims, owner):
    only = await shims.connect(owner, machine_id="m1")
    assert {await run(owner, *STAT) for _ in range(3)} == {"m1"}
    assert await run(owner, *COMMAND) == "m1"
    assert len(only.ops("FILE_STAT")) == 3


async def test_the_envelope_carries_the_session_and_the_chosen_machine(shims, owner):
    shim = await shims.connect(owner, machine_id="m1")
    await run(owner, *STAT, session="agt_0123456789ab")
    request = shim.ops("FILE_STAT")[0]
    assert request["session_id"] == "agt_0123456789ab"
    assert request["target_machine"] == "m1"
    assert request["version"] == "2.1"
    assert request["payload"] == STAT[1]


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (ALICE_ID, ALICE_ID),
        (ALICE_SERVER_ID, ALICE_SERVER_ID),
        ("laptop.LOCAL", ALICE_ID),
        ("BUILD-SERVER", ALICE_SERVER_ID),
        ("alice's laptop", ALICE_ID),
        ("build", ALICE_SERVER_ID),
        ("Lap", ALICE_ID),
        ("3f2b9c1e-b", ALICE_SERVER_ID),
        ("  build-server  ", ALICE_SERVER_ID),
    ],
)
async def test_an_explicit_target_is_matched_by_id_name_or_unique_prefix(two_machines, owner, target, expected):
    for _ in range(2):  # never round-robin: the same machine every time
        assert await run(owner, *COMMAND, target=target) == expected


async def test_an_exact_id_wins_over_a_prefix_of_another_machine(shims, owner):
    await shims.connect(owner, machine_id="box", hostname="h1")
    await shims.connect(owner, machine_id="box-2", hostname="h2")
    assert await run(owner, *COMMAND, target="box") == "box"


async def test_an_ambiguous_prefix_is_refused_listing_the_candidates(two_machines, owner):
    failure = await refusal(owner, *COMMAND, target="3f2b9c1e")
    assert failure.code == "MACHINE_AMBIGUOUS"
    assert {c["machine_id"] for c in failure.details["candidates"]} == {ALICE_ID, ALICE_SERVER_ID}
    assert "build-server" in failure.message and "Alice's Laptop" in failure.message
    laptop, server = two_machines
    assert laptop.ops("EXECUTE_COMMAND") == [] and server.ops("EXECUTE_COMMAND") == []


async def test_two_machines_with_the_same_host_name_are_ambiguous_by_name(shims, owner):
    await shims.connect(owner, machine_id="m1", hostname="raspberrypi")
    await shims.connect(owner, machine_id="m2", hostname="raspberrypi")
    assert (await refusal(owner, *COMMAND, target="RaspberryPi")).code == "MACHINE_AMBIGUOUS"


async def test_an_unknown_target_is_not_attached_and_never_close_enough(two_machines, owner):
    for target in ("nas", "laptop.localx", "3f2b9c1e-c", "x" + ALICE_ID):
        failure = await refusal(owner, *COMMAND, target=target)
        assert failure.code == "MACHINE_NOT_ATTACHED"
        assert failure.http_status == 404


async def test_no_machine_attached_is_machine_not_attached(owner):
    assert (await refusal(owner, *STAT)).code == "MACHINE_NOT_ATTACHED"
    assert (await refusal(owner, *STAT, target="laptop")).code == "MACHINE_NOT_ATTACHED"


# --- capability ---------------------------------------------------------------------------


async def test_a_machine_without_shell_never_receives_a_command(shims, owner):
    files_only = await shims.connect(owner, machine_id="files", capabilities=["files"])
    await shims.connect(owner, machine_id="both", capabilities=["shell", "files"])
    served = [await run(owner, *COMMAND) for _ in range(4)]
    assert served == ["both"] * 4
    assert files_only.ops("EXECUTE_COMMAND") == []


async def test_an_explicit_target_without_the_capability_is_refused(shims, owner):
    files_only = await shims.connect(owner, machine_id="files", capabilities=["files"])
    await shims.connect(owner, machine_id="both")
    failure = await refusal(owner, *COMMAND, target="files")
    assert failure.code == "CAPABILITY_NOT_GRANTED"
    assert failure.http_status == 403
    assert files_only.ops("EXECUTE_COMMAND") == []


async def test_no_capable_machine_is_capability_not_granted(shims, owner):
    await shims.connect(owner, machine_id="files", capabilities=["files"])
    assert (await refusal(owner, *COMMAND)).code == "CAPABILITY_NOT_GRANTED"


# --- locality and recency -----------------------------------------------------------------


async def test_a_path_inside_one_machines_roots_goes_to_that_machine(two_machines, owner):
    served = [await run(owner, "FILE_STAT", {"path": "/srv/data/x.csv"}) for _ in range(4)]
    assert served == [ALICE_SERVER_ID] * 4
    served = [await run(owner, "FILE_STAT", {"path": "/home/alice/../alice/a.txt"}) for _ in range(2)]
    assert served == [ALICE_ID] * 2


async def test_roots_are_compared_segment_by_segment(shims, owner):
    await shims.connect(owner, machine_id="al", allowed_roots=["/home/al"])
    await shims.connect(owner, machine_id="alice", allowed_roots=["/home/alice"])
    assert {await run(owner, "FILE_STAT", {"path": "/home/alice/x"}) for _ in range(3)} == {"alice"}


async def test_a_write_and_the_following_read_of_a_path_go_to_the_same_machine(shims, owner):
    await shims.connect(owner, machine_id="m1", allowed_roots=["/data"])
    await shims.connect(owner, machine_id="m2", allowed_roots=["/data"])
    for index in range(6):
        path = f"/data/file-{index}.txt"
        writer = await run(owner, "FILE_WRITE", {"path": path, "content": "x", "encoding": "utf-8"})
        reader = await run(owner, "FILE_READ", {"path": path, "encoding": "utf-8"})
        assert reader == writer, f"write went to {writer}, the read of {path} to {reader}"


async def test_recency_is_per_session(shims, owner):
    await shims.connect(owner, machine_id="m1", allowed_roots=["/data"])
    await shims.connect(owner, machine_id="m2", allowed_roots=["/data"])
    assert await run(owner, *COMMAND, session="a") == "m1"  # round-robin turn 0 of session a
    assert await run(owner, "FILE_WRITE", {"path": "/data/f", "content": "x"}, session="a") == "m2"
    # Session b has its own counter (turn 0: m1) and knows nothing of a's write to m2.
    assert await run(owner, "FILE_STAT", {"path": "/data/f"}, session="b") == "m1"
    assert await run(owner, "FILE_STAT", {"path": "/data/f"}, session="a") == "m2"


# --- default machine and round-robin -----------------------------------------------------------


async def test_round_robin_spreads_operations_across_capable_machines(shims, owner):
    await shims.connect(owner, machine_id="m1")
    await shims.connect(owner, machine_id="m2")
    served = [await run(owner, *COMMAND) for _ in range(6)]
    assert collections.Counter(served) == {"m1": 3, "m2": 3}
    assert all(a != b for a, b in itertools.pairwise(served))


async def test_the_default_machine_wins_over_round_robin(shims, owner, owner_token):
    await shims.connect(owner, machine_id="m1")
    await shims.connect(owner, machine_id="m2")
    response = await AsyncClient().put(
        "/api/v1/machines/default",
        {"machine_id": "m2"},
        content_type="application/json",
        headers={"authorization": f"Bearer {owner_token}"},
    )
    assert response.status_code == 200, response.content
    assert [await run(owner, *COMMAND) for _ in range(4)] == ["m2"] * 4
    # An explicit target still wins over the default.
    assert await run(owner, *COMMAND, target="m1") == "m1"


async def test_a_default_machine_that_is_not_capable_is_skipped(shims, owner):
    from channels.db import database_sync_to_async

    from machines.services.router import default_machine_set

    await shims.connect(owner, machine_id="files", capabilities=["files"])
    await shims.connect(owner, machine_id="both")
    await database_sync_to_async(default_machine_set)(user=owner, machine="files")
    assert [await run(owner, *COMMAND) for _ in range(2)] == ["both", "both"]


# --- sessions and users ---------------------------------------------------------------------


async def test_a_shim_attached_to_one_session_is_not_used_for_another(shims, owner):
    shim = await shims.connect(owner, machine_id="m1", sessions=["a"])
    assert await run(owner, *STAT, session="a") == "m1"
    for target in (None, "m1", "laptop"):
        failure = await refusal(owner, *STAT, session="b", target=target)
        assert failure.code == "MACHINE_NOT_ATTACHED"
    assert len(shim.ops("FILE_STAT")) == 1


async def test_another_users_session_never_reaches_the_shim_by_any_spelling(two_machines, owner, member):
    laptop, server = two_machines
    for target in (None, ALICE_ID, "Laptop.local", "alice's laptop", "build", "3f2b", ALICE_SERVER_ID[:12]):
        failure = await refusal(member, *COMMAND, target=target)
        assert failure.code == "MACHINE_NOT_ATTACHED", target
    assert laptop.ops("EXECUTE_COMMAND") == [] and server.ops("EXECUTE_COMMAND") == []
