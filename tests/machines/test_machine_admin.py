"""The machines admin's actions go through the services (every write is a
service: docs/architecture.md#the-layers)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User

from machines.models import Machine, MachineToken
from machines.services.device import machine_token_create

pytestmark = pytest.mark.django_db

MACHINE_ID = "3f2b9c1e-0000-4000-8000-0000000000a1"


def test_revoking_machine_tokens_in_the_admin_revokes_bound_machines_and_unbound_tokens(admin_client):
    owner = User.objects.create_user("owner-admin-tokens", password="pw-12345678")
    Machine.objects.create(user=owner, machine_id=MACHINE_ID, hostname="box", platform="linux", arch="x86_64")
    machine_token_create(user=owner, machine_id=MACHINE_ID)
    machine_token_create(user=owner, machine_id="")
    tokens = list(MachineToken.objects.filter(user=owner))
    assert len(tokens) == 2 and all(token.revoked_at is None for token in tokens)

    response = admin_client.post(
        "/admin/machines/machinetoken/", {"action": "revoke", "_selected_action": [token.pk for token in tokens]}
    )

    assert response.status_code == 302
    assert MachineToken.objects.filter(user=owner, revoked_at__isnull=True).count() == 0
    machine = Machine.objects.get(machine_id=MACHINE_ID)
    assert machine.revoked_at is not None and machine.status_reason == "revoked"
