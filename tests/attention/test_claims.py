"""Several delivery workers at once (each row claimed by a conditional update,
docs/notifications.md): racing claimers never claim one delivery twice, and together they
claim every due one."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
from django.db import connection

from attention import services
from attention.models import Delivery

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

CLAIMERS = 6


def test_racing_workers_never_claim_the_same_delivery(owner: Any) -> None:
    services.notification_settings_update(user=owner, apprise_urls=[f"json://127.0.0.1:9/{n}" for n in range(3)])
    for n in range(10):
        services.notify(user=owner, kind="finished", title="t", body="", url="http://x/", dedupe_key=f"k{n}")
    assert Delivery.objects.count() == 30

    barrier = threading.Barrier(CLAIMERS)
    claimed: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            barrier.wait()
            while batch := services.deliveries_claim(limit=4):
                with lock:
                    claimed.extend(delivery.pk for delivery in batch)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(CLAIMERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert Counter(claimed).most_common(1)[0][1] == 1
    assert sorted(claimed) == sorted(Delivery.objects.values_list("pk", flat=True))
    assert set(Delivery.objects.values_list("status", "attempts")) == {(Delivery.Status.SENDING, 1)}
