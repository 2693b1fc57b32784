"""Row deletes without Django's cascade collection, for the hot paths of connections.

``QuerySet.delete()`` first SELECTs every row it deletes (to run cascades and signals),
then DELETEs them: one statement more than needed for a row nothing refers to. Used by
a ``/ws`` session's close and a shim's connect and close."""

from __future__ import annotations

from typing import Any

from django.db import connection, models


def delete_returning(model: type[models.Model], field: str, value: Any, *returning: str) -> list[tuple[Any, ...]]:
    """Delete the rows of ``model`` whose ``field`` equals ``value``; the ``returning``
    fields of each deleted row, as tuples in that order (none asked: an empty list).

    One ``DELETE … RETURNING`` where the database has it (PostgreSQL, SQLite ≥ 3.35), else
    a SELECT and ``QuerySet.delete()``. No cascade and no delete signal runs: only for
    models no other row refers to with a cascade (the caller deletes those rows first).
    Field names are the model's (``"ws_session"`` or ``"ws_session_id"``); the columns are
    quoted by the backend and ``value`` is a parameter. Raises what the database raises."""
    rows = model._default_manager.filter(**{field: value})
    if returning and not connection.features.can_return_columns_from_insert:
        found = [tuple(row) for row in rows.values_list(*returning)]
        rows.delete()
        return found
    quote = connection.ops.quote_name
    sql = f"DELETE FROM {quote(model._meta.db_table)} WHERE {quote(_column(model, field))} = %s"  # noqa: S608
    if returning:
        sql += " RETURNING " + ", ".join(quote(_column(model, name)) for name in returning)
    with connection.cursor() as cursor:
        cursor.execute(sql, [value])
        return [tuple(row) for row in cursor.fetchall()] if returning else []


def _column(model: type[models.Model], field_name: str) -> str:
    """The database column of a concrete field of ``model`` (by name or attname)."""
    field = model._meta.get_field(field_name)
    assert isinstance(field, models.Field) and field.column is not None
    return str(field.column)
