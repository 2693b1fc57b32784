"""An old database survives the models' move to ``core`` and ``agents`` (every row kept;
docs/architecture.md#tables-keep-their-names).

Commit e3ac2de moved ``InstanceIdentity``, ``ServerProcess`` and ``ApiToken`` from the
``dispatch`` app to ``core``, and the agents' six models to ``agents``, with state-only
migrations (the tables keep their ``dispatch_*`` names); ``dispatch`` 0007 relabels their
content types. These tests build a database with the migrations as they were before the move
(``dispatch`` 0006, ``peers`` 0001, ``remotes`` 0002, ``machines`` 0003), put a row in every
table with the historical models, migrate it forward the way ``manage.py migrate`` does
(``post_migrate`` included) and read it back with today's models: every row, every relation,
the content types' ids, staff permissions and the admin log survive; the six new migrations
reverse and replay. That they emit no DDL is test_old_database_schema.py.

Each test works on a database of its own — a temporary SQLite file, or a fresh PostgreSQL
database (``tests.backends.postgres_database``) for the ``postgres`` variant — registered as an
extra connection alias for the test's duration (the helpers of tests/core/conftest.py); the
test database other tests use is never migrated (the tests route every query to their own
database and refuse ``default``).
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType
from django.db import connections
from django.db.migrations.executor import MigrationExecutor

from agents.models import Agent, AgentEvent, AgentMessage, AgentToken, Run, SupervisorLease
from core.models import ApiToken, InstanceIdentity, ServerProcess
from dispatch.models import McpStream
from machines.models import MachineConnection
from peers.models import OutboxMessage, Peer
from remotes.models import Remote, WsSession
from tests.core.conftest import (
    DISPATCH_APPS,
    MOVED,
    NEW_APPS,
    NEW_MIGRATIONS,
    OLD_LEAVES,
    backends,
    dump,
    extra_database,
    latest_nodes,
    migrate,
    moved_nodes,
    old_nodes,
    old_targets,
    routed_to,
)

pytestmark = pytest.mark.usefixtures("_own_databases_only")

CORE_MODELS = (InstanceIdentity, ServerProcess, ApiToken)
AGENTS_MODELS = (Agent, Run, AgentEvent, AgentMessage, AgentToken, SupervisorLease)
NOW = datetime.datetime(2026, 11, 30, 12, 0, tzinfo=datetime.UTC)


def relabelled(tables: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """``tables`` as the move should leave them: the moved models' content types relabelled."""
    result = dict(tables)
    result["django_content_type"] = [
        {**row, "app_label": MOVED[row["model"]]} if row["app_label"] == "dispatch" and row["model"] in MOVED else row
        for row in tables["django_content_type"]
    ]
    return result


# --- the old database ------------------------------------------------------------------------


def fill(apps: Any) -> None:
    """Put rows, related to one another, in every table of the Dispatch apps (and in auth's,
    admin's and sessions'), with the historical models in ``apps`` (the old state)."""
    get = apps.get_model
    User, Group, Permission = get("auth", "User"), get("auth", "Group"), get("auth", "Permission")
    ContentTypeThen = get("contenttypes", "ContentType")

    alice = User.objects.create(username="alice", password="!", is_staff=True)
    bob = User.objects.create(username="bob", password="!")
    # Staff rights: on moved models and on one that stays (McpStream), one through a group.
    operators = Group.objects.create(name="operators")
    alice.groups.add(operators)
    alice.user_permissions.add(
        Permission.objects.get(content_type__app_label="dispatch", codename="change_agent"),
        Permission.objects.get(content_type__app_label="dispatch", codename="delete_apitoken"),
        Permission.objects.get(content_type__app_label="dispatch", codename="view_mcpstream"),
    )
    operators.permissions.add(Permission.objects.get(content_type__app_label="dispatch", codename="view_run"))
    get("sessions", "Session").objects.create(
        session_key="s" * 32, session_data="e30", expire_date=NOW + datetime.timedelta(days=14)
    )

    # dispatch (core's models to be)
    get("dispatch", "InstanceIdentity").objects.filter(pk=1).update(public_key="p" * 43)  # made by 0001
    process = get("dispatch", "ServerProcess").objects.create(
        id="proc-old", kind="serve", hostname="old-host", pid=4242
    )
    api_token = get("dispatch", "ApiToken").objects.create(
        user=alice, name="laptop", prefix="dsp_abcd", digest="a" * 64, last_used_at=NOW
    )

    # peers (the models that keep their app, with keys to the moved ones)
    peer = get("peers", "Peer").objects.create(
        owner=alice,
        instance_id="inst_0123456789ab",
        label="lab",
        url="https://lab.example",
        public_key="k" * 43,
        fingerprint="f" * 39,
        inbound_digest="i" * 64,
        inbound_prefix="dsp_peer",
        outbound_token_encrypted="sealed",
    )
    get("peers", "PairingOffer").objects.create(
        created_by=alice, link_user=alice, peer=peer, code_digest="c" * 64, expires_at=NOW, used_at=NOW
    )
    get("peers", "PeerLease").objects.create(peer=peer, kind="mirror", holder="proc-old", expires_at=NOW)
    get("peers", "PeerReceipt").objects.create(
        peer=peer, idempotency_key="rcpt-1", route="message", body_digest="b" * 64, response_status=202
    )

    # dispatch (agents' models to be)
    Agent_ = get("dispatch", "Agent")
    lead = Agent_.objects.create(
        id="agt_0000000000a1", owner=alice, name="lead", type="claude", cwd="/srv", status="running"
    )
    helper = Agent_.objects.create(
        id="agt_0000000000a2", owner=alice, name="helper", type="codex", cwd="/srv/x", parent=lead, launched_by=lead
    )
    shadow = Agent_.objects.create(
        id="agt_0000000000a3",
        owner=alice,
        name="lab-agent",
        type="claude",
        cwd="/",
        peer=peer,
        peer_agent_id="agt_remote000001",
    )
    run = get("dispatch", "Run").objects.create(
        id="run_0000000000r1", agent=lead, input={"prompt": "hi"}, status="succeeded", output="done"
    )
    get("dispatch", "AgentEvent").objects.create(
        agent=lead, run=run, type="done", message="finished", metadata={"k": 1}
    )
    get("dispatch", "AgentEvent").objects.create(agent=shadow, type="working", mirrored=True, created_at=NOW)
    outgoing = get("dispatch", "AgentMessage").objects.create(
        recipient_agent=shadow,
        sender_agent=lead,
        sender_user=alice,
        peer=peer,
        content="hello lab",
        idempotency_key="m-1",
    )
    get("dispatch", "AgentMessage").objects.create(
        recipient_agent=helper,
        sender_peer=peer,
        sender_address={"instance": "lab"},
        content="hi back",
        status="delivered",
    )
    agent_token = get("dispatch", "AgentToken").objects.create(agent=lead, prefix="dsp_agnt", digest="t" * 64)
    get("dispatch", "SupervisorLease").objects.create(host="old-host", holder="proc-old", expires_at=NOW)
    get("dispatch", "McpStream").objects.create(user=alice, server_process=process, api_token=api_token)
    get("dispatch", "McpStream").objects.create(user=alice, server_process=process, agent_token=agent_token)
    get("peers", "OutboxMessage").objects.create(
        peer=peer,
        message=outgoing,
        idempotency_key="m-1",
        to_agent_id="agt_remote000001",
        payload={"content": "hello lab"},
    )

    # remotes
    session = get("remotes", "WsSession").objects.create(
        id="ws" + "0" * 30,
        channel_name="specific.ws!1",
        auth_method="token",
        server_process=process,
        user=alice,
        api_token=api_token,
    )
    get("remotes", "Remote").objects.create(
        name="weather",
        channel_name="specific.ws!1",
        tools=[{"name": "forecast"}],
        server_process=process,
        user=alice,
        ws_session=session,
    )

    # machines
    machine = get("machines", "Machine").objects.create(user=alice, machine_id="m-1", hostname="box")
    machine_token = get("machines", "MachineToken").objects.create(
        user=alice, machine_id="m-1", prefix="dsp_mach", digest="m" * 64
    )
    get("machines", "MachineConnection").objects.create(
        connection_id="conn-1",
        channel_name="specific.shim!1",
        protocol_version="1",
        machine=machine,
        server_process=process,
        user=alice,
        api_token=api_token,
        machine_token=machine_token,
    )
    get("machines", "DefaultMachine").objects.create(user=alice, machine_id="m-1")
    get("machines", "DeviceAuthorization").objects.create(
        user=bob,
        device_code_digest="d" * 64,
        user_code_digest="u" * 64,
        machine_id="m-2",
        hostname="new-box",
        platform="linux",
        arch="x86_64",
        expires_at=NOW,
    )
    get("machines", "RoutingCounter").objects.create(user=alice, session_id="agt_0000000000a1", value=3)
    get("machines", "PathRecency").objects.create(
        user=alice, session_id="agt_0000000000a1", path="/srv", machine_id="m-1"
    )
    get("machines", "AuditRecord").objects.create(
        user=alice, session_id="agt_0000000000a1", request_id="r-1", op="exec", caller="agent"
    )

    # admin history about the lead agent
    get("admin", "LogEntry").objects.create(
        user=alice,
        content_type=ContentTypeThen.objects.get(app_label="dispatch", model="agent"),
        object_id=lead.pk,
        object_repr="lead",
        action_flag=2,
        change_message="[]",
    )


def build_old_database(alias: str) -> dict[str, list[dict[str, Any]]]:
    """Migrate ``alias`` to the state before the move, fill it; returns its tables' rows."""
    plan = migrate(alias, old_targets())
    assert not {(m.app_label, m.name) for m, _ in plan} & NEW_MIGRATIONS
    old_apps = MigrationExecutor(connections[alias]).loader.project_state(old_nodes()).apps
    with routed_to(alias):
        fill(old_apps)
    tables = dump(alias)
    for label in DISPATCH_APPS:
        for model in old_apps.get_app_config(label).get_models():
            assert tables[model._meta.db_table], f"no row in {model._meta.db_table}"
    assert {row["app_label"] for row in tables["django_content_type"]} >= {"dispatch", "peers", "remotes", "machines"}
    assert not {row["app_label"] for row in tables["django_content_type"]} & set(NEW_APPS)
    return tables


# --- what today's code must find -------------------------------------------------------------


def check_at_the_latest_migrations(alias: str, old: dict[str, list[dict[str, Any]]]) -> None:
    """Migrate ``alias`` on to the latest migrations (the ones after the move add columns
    and tables today's models read, e.g. ``peers`` 0003) and check the rows with today's
    models: a test's last step (their ``post_migrate`` adds content types)."""
    migrate(alias, latest_nodes())
    with routed_to(alias):
        check_with_todays_models(old)


def check_with_todays_models(old: dict[str, list[dict[str, Any]]]) -> None:
    """Read the migrated database with today's models and Django's auth and admin."""
    content_type_ids = {row["model"]: row["id"] for row in old["django_content_type"] if row["app_label"] == "dispatch"}
    assert {model._meta.model_name: model._meta.app_label for model in (*CORE_MODELS, *AGENTS_MODELS)} == MOVED
    for model in (*CORE_MODELS, *AGENTS_MODELS):
        content_type = ContentType.objects.get_for_model(model)
        assert content_type.pk == content_type_ids[model._meta.model_name], model
        assert content_type.app_label == model._meta.app_label
    assert ContentType.objects.get_for_model(McpStream).pk == content_type_ids["mcpstream"]
    assert set(ContentType.objects.filter(app_label="dispatch").values_list("model", flat=True)) == {"mcpstream"}

    alice = get_user_model().objects.get(username="alice")
    assert alice.has_perm("agents.change_agent")
    assert alice.has_perm("agents.view_run")  # through her group
    assert alice.has_perm("core.delete_apitoken")
    assert alice.has_perm("dispatch.view_mcpstream")
    assert not alice.has_perm("dispatch.change_agent")
    assert not alice.has_perm("agents.delete_agent")

    lead = Agent.objects.get(name="lead")
    log = LogEntry.objects.get()
    assert log.content_type.model_class() is Agent
    assert log.get_edited_object() == lead
    assert log.get_admin_url() == f"/admin/agents/agent/{quote(lead.pk)}/change/"

    assert InstanceIdentity.objects.get().public_key == "p" * 43
    assert (lead.owner.username, lead.status, lead.cwd) == ("alice", "running", "/srv")
    assert {agent.name for agent in lead.children.all()} == {"helper"}
    assert Agent.objects.get(name="helper").launched_by == lead
    run = lead.runs.get()
    assert (run.pk, run.input, run.output) == ("run_0000000000r1", {"prompt": "hi"}, "done")
    assert run.events.get().message == "finished"
    assert lead.tokens.get().digest == "t" * 64

    peer = Peer.objects.get()
    shadow = peer.shadow_agents.get()
    assert (shadow.name, shadow.peer_agent_id) == ("lab-agent", "agt_remote000001")
    outbox = OutboxMessage.objects.get()
    assert outbox.message.recipient_agent == shadow
    assert outbox.message.sender_agent == lead
    assert outbox.message.sender_user == alice
    assert outbox.message.peer == peer
    assert AgentMessage.objects.get(sender_peer=peer).recipient_agent.name == "helper"
    assert peer.messages_received.get().sender_address == {"instance": "lab"}
    assert SupervisorLease.objects.get().holder == "proc-old"

    process = ServerProcess.objects.get()
    api_token = ApiToken.objects.get()
    assert (api_token.user, api_token.name) == (alice, "laptop")
    assert {(s.api_token, s.agent_token) for s in McpStream.objects.filter(server_process=process)} == {
        (api_token, None),
        (None, lead.tokens.get()),
    }
    session = WsSession.objects.get()
    assert (session.api_token, session.server_process) == (api_token, process)
    assert Remote.objects.get().ws_session.server_process == process
    assert process.remotes.get().name == "weather"
    connection = MachineConnection.objects.get()
    assert (connection.api_token, connection.server_process) == (api_token, process)
    assert connection.machine.machine_id == "m-1"
    assert process.machine_connections.get() == connection

    # New rows continue after the old ones (PostgreSQL's sequences stayed with the tables).
    event = AgentEvent.objects.create(agent=lead, type="idle")
    assert event.pk > max(row["id"] for row in old["dispatch_agentevent"])
    event.delete()


# --- the tests -------------------------------------------------------------------------------


@backends
def test_an_old_database_migrates_forward_with_every_row_and_back(backend: str, tmp_path: Path) -> None:
    with extra_database(backend, tmp_path, "old") as alias:
        old = build_old_database(alias)

        plan = migrate(alias, moved_nodes())
        assert {(m.app_label, m.name) for m, backwards in plan if not backwards} == NEW_MIGRATIONS
        assert dump(alias) == relabelled(old)  # post_migrate made no new content type or permission
        # (today's models read the rows at the end: the later migrations' post_migrate adds
        # content types that would stay in the dumps compared before that)

        plan = migrate(alias, old_targets())
        assert {(m.app_label, m.name) for m, backwards in plan if backwards} == NEW_MIGRATIONS
        assert dump(alias) == old
        with routed_to(alias):
            alice = get_user_model().objects.get(username="alice")
            assert alice.has_perm("dispatch.change_agent")
            assert not alice.has_perm("agents.change_agent")

        migrate(alias, moved_nodes())
        assert dump(alias) == relabelled(old)
        check_at_the_latest_migrations(alias, old)


@backends
def test_content_types_made_between_the_two_steps_give_way_to_the_old_ones(backend: str, tmp_path: Path) -> None:
    """``migrate core`` / ``migrate agents`` run alone first: their ``post_migrate`` makes
    empty ``core.*`` and ``agents.*`` content types (and permissions), then ``dispatch`` 0007
    removes them and relabels the old rows, which the permissions and the log point at."""
    with extra_database(backend, tmp_path, "old") as alias:
        old = build_old_database(alias)

        all_but_dispatch = [node for node in moved_nodes() if node[0] != "dispatch"]
        migrate(alias, [*all_but_dispatch, ("dispatch", OLD_LEAVES["dispatch"])])
        between = dump(alias)["django_content_type"]
        newcomers = {(label, model) for model, label in MOVED.items()}
        assert {(row["app_label"], row["model"]) for row in between} >= newcomers
        assert len(between) == len(old["django_content_type"]) + len(MOVED)

        migrate(alias, moved_nodes())
        assert dump(alias) == relabelled(old)
        check_at_the_latest_migrations(alias, old)
