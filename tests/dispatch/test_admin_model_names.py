"""The admin names every model in plain English: no "Server processs"."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


def test_the_admin_index_says_server_processes(admin_client):
    page = admin_client.get("/admin/").content.decode()
    assert "Server processes" in page
    assert "processs" not in page
