"""Claiming runs from several threads at once (a conditional update under the agent's row
lock): no run is claimed
twice, and an agent never has two running runs."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from django.db import connection

from agents.models import Run
from agents.services import run_claim_next, run_enqueue

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

CLAIMERS = 6


def race(claim_rounds: int) -> list[tuple[str, str]]:
    """Start CLAIMERS threads together; each claims up to ``claim_rounds`` times."""
    barrier = threading.Barrier(CLAIMERS)
    claims: list[tuple[str, str]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def claimer(process_id: str) -> None:
        try:
            barrier.wait()
            for _ in range(claim_rounds):
                run = run_claim_next(process_id=process_id)
                if run is None:
                    break
                with lock:
                    claims.append((run.pk, process_id))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=claimer, args=(f"proc_{n}",)) for n in range(CLAIMERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return claims


def test_racing_claimers_never_claim_the_same_run(owner, make_agent):
    runs = [run_enqueue(agent=make_agent(owner, name=f"a{n}"), instruction="go") for n in range(24)]

    claims = race(claim_rounds=24)

    claimed_ids = [run_id for run_id, _ in claims]
    assert Counter(claimed_ids).most_common(1)[0][1] == 1
    assert sorted(claimed_ids) == sorted(run.pk for run in runs)
    for run_id, process_id in claims:
        assert Run.objects.get(pk=run_id).claimed_by == process_id


def test_racing_claimers_take_only_one_run_of_a_busy_agent(owner, make_agent):
    agent = make_agent(owner)
    first = run_enqueue(agent=agent, instruction="1")
    for n in range(2, 8):
        run_enqueue(agent=agent, instruction=str(n))

    claims = race(claim_rounds=3)

    assert [run_id for run_id, _ in claims] == [first.pk]
    assert Run.objects.filter(status="running").count() == 1
    assert Run.objects.filter(status="queued").count() == 6
