"""Shared pieces of the core tests: the migrations of an old database
(test_old_database.py, test_old_database_schema.py), each test on a database of its own
registered as an extra connection alias — a temporary SQLite file, or a fresh PostgreSQL
database (``tests.backends.postgres_database``) for the ``postgres`` variant.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import dj_database_url
import pytest
from django.contrib.contenttypes.models import ContentType
from django.core.management.sql import emit_post_migrate_signal
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.test import override_settings

from tests.backends import postgres_database

# The apps whose tables the old migrations made, and the apps the move created.
DISPATCH_APPS = ("dispatch", "remotes", "machines", "peers")
NEW_APPS = ("core", "agents")
# Each Dispatch app's leaf migration before the move.
OLD_LEAVES = {
    "dispatch": "0006_mcp_stream",
    "peers": "0001_initial",
    "remotes": "0002_wssession_credential",
    "machines": "0003_machineconnection_credential",
}
# The move: state only.
NEW_MIGRATIONS = {
    ("core", "0001_initial"),
    ("agents", "0001_initial"),
    ("remotes", "0003_foreign_keys_to_core"),
    ("machines", "0004_foreign_keys_to_core"),
    ("peers", "0002_foreign_key_to_agents"),
    ("dispatch", "0007_models_moved_to_core_and_agents"),
}
# Moved model (content type ``model``) -> its new app label.
MOVED = {
    "instanceidentity": "core",
    "serverprocess": "core",
    "apitoken": "core",
    "agent": "agents",
    "run": "agents",
    "agentevent": "agents",
    "agentmessage": "agents",
    "agenttoken": "agents",
    "supervisorlease": "agents",
}


@pytest.fixture
def _own_databases_only(django_db_blocker: Any) -> Iterator[None]:
    """The tests use databases of their own, which pytest-django's test case would refuse
    (it allows only the aliases it set up), so they run outside it, with database access
    unblocked — and the default database refused instead: a query that strays there fails
    the test rather than touching the test database (or, run alone, a real one). Each
    module using these databases asks for it (``pytest.mark.usefixtures``)."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a query went to the default database, not the one under test")

    default = connections[DEFAULT_DB_ALIAS]
    default.ensure_connection = refuse  # type: ignore[method-assign]
    try:
        with django_db_blocker.unblock():
            yield
    finally:
        del default.ensure_connection  # the class's (pytest-django's blocker) again


backends = pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])


# --- the databases ---------------------------------------------------------------------------


@contextmanager
def extra_database(backend: str, directory: Path, alias: str) -> Iterator[str]:
    """A fresh, empty database reachable as ``connections[alias]`` while the block runs.

    ``backend`` is ``"sqlite"`` (a file in ``directory``, with the transaction mode
    settings.py gives every SQLite database) or ``"postgres"`` (a new database on the test
    server, dropped after; skipped without one, failed under CI=true). Yields ``alias``; the
    alias is gone again afterwards, so pytest-django's teardown never sees it.
    """
    with ExitStack() as stack:
        if backend == "sqlite":
            settings_dict: dict[str, Any] = {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": str(directory / f"{alias}.sqlite3"),
                "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
            }
        else:
            settings_dict = dict(dj_database_url.parse(stack.enter_context(postgres_database("dispatch_olddb_"))))
        connections.settings[alias] = connections.configure_settings({DEFAULT_DB_ALIAS: {}, alias: settings_dict})[
            alias
        ]
        try:
            yield alias
        finally:
            for connection in connections.all(initialized_only=True):
                if connection.alias == alias:
                    connection.close()
                    del connections[alias]
            del connections.settings[alias]
            ContentType.objects.clear_cache()


class OnlyThere:
    """A database router sending every query to one alias, so today's models (and Django's
    auth and admin code that queries without ``using``) read the database under test."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return self.alias

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return self.alias

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool:
        return True


@contextmanager
def routed_to(alias: str) -> Iterator[None]:
    """Route every query to ``alias`` while the block runs (content type cache emptied): the
    database under test is what ``default`` is in a deployment."""
    ContentType.objects.clear_cache()
    with override_settings(DATABASE_ROUTERS=[OnlyThere(alias)]):
        yield
    ContentType.objects.clear_cache()


# --- migrating -------------------------------------------------------------------------------


def latest_nodes() -> list[tuple[str, str]]:
    """Every app's leaf migration today."""
    return sorted(MigrationLoader(None, ignore_no_migrations=True).graph.leaf_nodes())


def moved_nodes() -> list[tuple[str, str]]:
    """The leaf migrations right after the move: Django's apps as today, Dispatch's at the
    move's own migrations (``NEW_MIGRATIONS``; later migrations, e.g. ``machines`` 0005, are
    not the move's to test)."""
    keep = [node for node in latest_nodes() if node[0] not in (*DISPATCH_APPS, *NEW_APPS)]
    return [*keep, *sorted(NEW_MIGRATIONS)]


def old_nodes() -> list[tuple[str, str]]:
    """The leaf migrations before the move: Django's apps as today, Dispatch's as ``OLD_LEAVES``."""
    keep = [node for node in latest_nodes() if node[0] not in (*DISPATCH_APPS, *NEW_APPS)]
    return [*keep, *OLD_LEAVES.items()]


def old_targets() -> list[tuple[str, str | None]]:
    """Migration targets for the old state: the old leaves, ``core`` and ``agents`` unapplied."""
    return [*old_nodes(), ("core", None), ("agents", None)]


def migrate(alias: str, targets: list[Any]) -> list[tuple[Any, bool]]:
    """Migrate ``alias`` to ``targets`` as ``manage.py migrate`` does: the plan, then
    ``post_migrate`` with the resulting state (which creates content types and permissions).
    Returns the plan that ran: ``(Migration, backwards)`` pairs.

    Queries are routed to ``alias`` (``dispatch`` 0001's ``RunPython`` writes without
    ``using``, to what is the one database in a deployment)."""
    executor = MigrationExecutor(connections[alias])
    plan = executor.migration_plan(targets)
    if plan:
        with routed_to(alias):
            state = executor.migrate(targets, plan=plan)
            state.clear_delayed_apps_cache()
            emit_post_migrate_signal(0, False, alias, apps=state.apps, plan=plan)
    return plan


def dump(alias: str) -> dict[str, list[dict[str, Any]]]:
    """Every table's rows (as column -> value, by primary key), ``django_migrations`` excepted."""
    connection = connections[alias]
    quote = connection.ops.quote_name
    tables: dict[str, list[dict[str, Any]]] = {}
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            if table == "django_migrations":
                continue
            pk = connection.introspection.get_primary_key_column(cursor, table)
            cursor.execute(f"SELECT * FROM {quote(table)} ORDER BY {quote(pk)}")
            columns = [column[0] for column in cursor.description]
            tables[table] = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
    return tables
