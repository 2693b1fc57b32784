"""The models' move to ``core`` and ``agents`` changes no table
(docs/architecture.md#tables-keep-their-names).

The six migrations of the move (commit e3ac2de) are state only: ``sqlmigrate`` of each,
both ways, emits no DDL, and tables created from today's migration state are the tables the
old migrations made. Every row surviving the move is test_old_database.py; each test works
on databases of its own (the helpers of tests/core/conftest.py), never the test database.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.db import connections
from django.db.migrations.executor import MigrationExecutor

from tests.core.conftest import (
    MOVED,
    NEW_APPS,
    NEW_MIGRATIONS,
    backends,
    dump,
    extra_database,
    latest_nodes,
    migrate,
    moved_nodes,
    old_targets,
)

pytestmark = pytest.mark.usefixtures("_own_databases_only")

# Models the new apps gained after the move (content types of their own, never moved).
ADDED_SINCE = {"trustedfolder", "approval", "approvalrule"}


@backends
def test_the_move_changes_no_table(backend: str, tmp_path: Path) -> None:
    """``sqlmigrate`` of each new migration, both ways, is comments only."""
    with extra_database(backend, tmp_path, "old") as alias:
        migrate(alias, old_targets())
        executor = MigrationExecutor(connections[alias])
        forwards = executor.migration_plan(moved_nodes())
        assert {(m.app_label, m.name) for m, _ in forwards} == NEW_MIGRATIONS
        for step in forwards:
            statements = executor.loader.collect_sql([step])
            assert [s for s in statements if not s.lstrip().startswith("--")] == [], step

        migrate(alias, moved_nodes())
        executor = MigrationExecutor(connections[alias])
        backwards = executor.migration_plan(old_targets())
        assert {(m.app_label, m.name) for m, back in backwards if back} == NEW_MIGRATIONS
        for step in backwards:
            statements = executor.loader.collect_sql([step])
            assert [s for s in statements if not s.lstrip().startswith("--")] == [], step


def schema(alias: str) -> dict[str, Any]:
    """Every table's columns and constraints as introspected, ``django_migrations`` and the
    OAuth library's tables excepted.

    SQLite names foreign keys and unique indexes by their column's position (``fk_0``,
    ``sqlite_autoindex_<table>_1``), which a state-only move may change; those compare by
    what they constrain."""
    connection = connections[alias]
    positional = connection.vendor == "sqlite"
    tables: dict[str, Any] = {}
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            # django-oauth-toolkit's tables are the library's: on PostgreSQL its migration
            # history (fields altered many times) leaves index names its final state does
            # not make, which says nothing of Dispatch's own state-only move.
            if table == "django_migrations" or table.startswith("oauth2_provider_"):
                continue
            columns = {info.name: info for info in connection.introspection.get_table_description(cursor, table)}
            constraints = []
            for name, details in connection.introspection.get_constraints(cursor, table).items():
                if positional and (details["foreign_key"] or name.startswith("sqlite_autoindex_")):
                    name = ""
                constraints.append((name, repr(sorted(details.items()))))
            tables[table] = (columns, sorted(constraints))
    return tables


@backends
def test_the_new_state_describes_the_tables_the_old_migrations_made(backend: str, tmp_path: Path) -> None:
    """Tables created from today's migration state are the tables the old migrations made:
    the state-only move claims nothing the database does not have."""
    with extra_database(backend, tmp_path, "migrated") as migrated, extra_database(backend, tmp_path, "fresh") as fresh:
        migrate(migrated, latest_nodes())
        state_apps = MigrationExecutor(connections[fresh]).loader.project_state(latest_nodes()).apps
        with connections[fresh].schema_editor() as editor:
            for model in state_apps.get_models():
                editor.create_model(model)
        assert schema(fresh) == schema(migrated)
        # A new installation has no content type left under the old label either.
        content_types = dump(migrated)["django_content_type"]
        assert {row["model"] for row in content_types if row["app_label"] == "dispatch"} == {"mcpstream"}
        assert {row["model"] for row in content_types if row["app_label"] in NEW_APPS} == set(MOVED) | ADDED_SINCE
