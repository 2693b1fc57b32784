"""Agent creation and the expert agent's run lifecycle (docs/agents.md#the-expert-agent):
running from creation, FIFO queue, one run at a time, cancel, orphans failed and
never replayed, a stopped agent refuses prompts."""

from __future__ import annotations

import os

import pytest

from agents.models import AgentEvent, Run
from agents.services import (
    WORKER_LOST,
    agent_archive,
    agent_create,
    agent_set_status,
    prompt_options_validate,
    run_cancel,
    run_claim_next,
    run_enqueue,
    run_finish,
    runs_fail_orphaned,
)
from core.errors import DispatchError

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]


# --- creation ----------------------------------------------------------------------------


def test_an_expert_agent_is_running_from_creation_and_a_cli_agent_starts_creating(owner, make_agent):
    expert = make_agent(owner, type="expert")
    shell = make_agent(owner, type="shell")

    assert expert.status == "running"
    assert shell.status == "creating"
    assert expert.id.startswith("agt_") and len(expert.id) == 16
    assert all(c in "0123456789abcdef" for c in expert.id[4:])


@pytest.mark.parametrize("name", ["", "   ", "x" * 101])
def test_it_refuses_a_name_outside_1_to_100_characters(owner, workdir, name):
    with pytest.raises(DispatchError, match="name must be 1 to 100"):
        agent_create(owner=owner, type="expert", name=name, cwd=workdir)


def test_it_accepts_a_name_with_colons_and_trims_it(owner, workdir):
    agent = agent_create(owner=owner, type="expert", name="  build: app  ", cwd=workdir)

    assert agent.name == "build: app"


@pytest.mark.parametrize("cwd", ["relative/dir", "", "/definitely/not/here", "/etc/hostname"])
def test_it_refuses_a_cwd_that_is_not_an_absolute_existing_directory(owner, cwd):
    with pytest.raises(DispatchError) as refused:
        agent_create(owner=owner, type="expert", name="a", cwd=cwd)

    assert refused.value.code == "INVALID_REQUEST"
    assert "cwd" in refused.value.message


def test_it_expands_a_leading_tilde_in_cwd(owner):
    agent = agent_create(owner=owner, type="expert", name="a", cwd="~")

    assert agent.cwd == os.path.normpath(os.path.expanduser("~"))


def test_it_refuses_an_unknown_type_listing_the_known_ones(owner, workdir):
    with pytest.raises(DispatchError, match="known types: expert, claude"):
        agent_create(owner=owner, type="robot", name="a", cwd=workdir)


def test_it_refuses_another_users_agent_as_parent(owner, outsider, make_agent, workdir):
    theirs = make_agent(outsider)

    with pytest.raises(DispatchError) as refused:
        agent_create(owner=owner, type="expert", name="child", cwd=workdir, parent=theirs)

    assert refused.value.code == "NOT_FOUND"


def test_it_records_parent_and_launcher(owner, make_agent):
    parent = make_agent(owner, name="lead")
    child = make_agent(owner, name="helper", parent=parent, launched_by=parent)

    assert (child.parent_id, child.launched_by_id) == (parent.pk, parent.pk)


# --- prompts -------------------------------------------------------------------------------


def test_a_prompt_stores_instruction_input_and_every_option(owner, make_agent):
    agent = make_agent(owner)

    run = run_enqueue(agent=agent, instruction="weather?", input={"city": "Rome"}, remotes=["weather-service"])

    assert run.id.startswith("run_") and len(run.id) == 16
    assert run.status == "queued"
    assert run.input == {"instruction": "weather?", "input": {"city": "Rome"}, "remotes": ["weather-service"]}


@pytest.mark.parametrize("reserved", ["instruction", "input"])
def test_it_refuses_options_using_a_reserved_key(reserved):
    with pytest.raises(DispatchError, match=f"reserved key '{reserved}'"):
        prompt_options_validate({reserved: "x", "remotes": []})


def test_it_refuses_options_that_are_not_json(owner, make_agent):
    agent = make_agent(owner)

    with pytest.raises(DispatchError, match="JSON"):
        run_enqueue(agent=agent, instruction="x", remotes={1, 2})
    assert not Run.objects.exists()


@pytest.mark.parametrize("instruction", ["", "  \n", None])
def test_it_refuses_an_empty_instruction(owner, make_agent, instruction):
    agent = make_agent(owner)

    with pytest.raises(DispatchError, match="instruction"):
        run_enqueue(agent=agent, instruction=instruction)


def test_a_stopped_expert_agent_refuses_prompts(owner, make_agent):
    agent = make_agent(owner)
    agent_set_status(agent=agent, status="stopped")

    with pytest.raises(DispatchError) as refused:
        run_enqueue(agent=agent, instruction="hello")

    assert refused.value.code == "CONFLICT"
    assert "not running" in refused.value.message
    assert not Run.objects.exists()


def test_prompting_a_cli_agent_creates_no_run(owner, make_agent):
    agent = make_agent(owner, type="shell")
    agent_set_status(agent=agent, status="running")

    with pytest.raises(DispatchError, match="messages, not runs"):
        run_enqueue(agent=agent, instruction="make")
    assert not Run.objects.exists()


# --- the queue ---------------------------------------------------------------------------


def test_runs_of_one_agent_are_claimed_one_at_a_time_first_in_first_out(owner, make_agent):
    agent = make_agent(owner)
    first, second, third = (run_enqueue(agent=agent, instruction=f"step {n}") for n in (1, 2, 3))

    claimed = run_claim_next(process_id="proc_a")
    assert claimed.pk == first.pk
    assert (claimed.status, claimed.claimed_by) == ("running", "proc_a")
    assert claimed.started_at is not None
    assert run_claim_next(process_id="proc_b") is None  # the agent is busy

    run_finish(run=claimed, status="succeeded", output="done 1")
    assert run_claim_next(process_id="proc_b").pk == second.pk
    assert run_claim_next(process_id="proc_b") is None
    run_finish(run=second, status="failed", error="boom")
    assert run_claim_next(process_id="proc_a").pk == third.pk


def test_runs_of_different_agents_proceed_side_by_side(owner, member, make_agent):
    one, two = make_agent(owner, name="one"), make_agent(member, name="two")
    run_one = run_enqueue(agent=one, instruction="a")
    run_two = run_enqueue(agent=two, instruction="b")

    claimed = {run_claim_next(process_id="p").pk, run_claim_next(process_id="p").pk}

    assert claimed == {run_one.pk, run_two.pk}


def test_a_finished_run_keeps_its_output_and_timestamps(owner, make_agent):
    agent = make_agent(owner)
    run_enqueue(agent=agent, instruction="a")
    run = run_claim_next(process_id="p")

    run_finish(run=run, status="succeeded", output="It is sunny in Rome.")

    stored = Run.objects.get(pk=run.pk)
    assert (stored.status, stored.output, stored.error) == ("succeeded", "It is sunny in Rome.", "")
    assert stored.finished_at >= stored.started_at


def test_it_refuses_to_finish_a_run_with_a_non_final_status(owner, make_agent):
    agent = make_agent(owner)
    run_enqueue(agent=agent, instruction="a")
    run = run_claim_next(process_id="p")

    with pytest.raises(DispatchError):
        run_finish(run=run, status="queued")
    assert Run.objects.get(pk=run.pk).status == "running"


def test_queued_runs_of_a_stopped_agent_wait(owner, make_agent):
    agent = make_agent(owner)
    run_enqueue(agent=agent, instruction="a")
    agent_set_status(agent=agent, status="stopped")

    assert run_claim_next(process_id="p") is None
    assert Run.objects.get().status == "queued"


# --- cancel ------------------------------------------------------------------------------


def test_cancelling_a_queued_run_skips_it(owner, make_agent):
    agent = make_agent(owner)
    first, second, third = (run_enqueue(agent=agent, instruction=f"step {n}") for n in (1, 2, 3))
    run_claim_next(process_id="p")

    cancelled = run_cancel(user=owner, run_id=second.pk)
    run_finish(run=first, status="succeeded")

    assert cancelled.status == "cancelled"
    assert cancelled.finished_at is not None
    assert run_claim_next(process_id="p").pk == third.pk


def test_cancelling_a_running_run_frees_the_agent_and_drops_the_late_result(owner, make_agent):
    agent = make_agent(owner)
    run_enqueue(agent=agent, instruction="long job")
    later = run_enqueue(agent=agent, instruction="next")
    running = run_claim_next(process_id="p")

    run_cancel(user=owner, run_id=running.pk)
    run_finish(run=running, status="succeeded", output="too late")

    stored = Run.objects.get(pk=running.pk)
    assert (stored.status, stored.output) == ("cancelled", "")
    assert run_claim_next(process_id="p").pk == later.pk


def test_it_refuses_to_cancel_a_finished_run(owner, make_agent):
    agent = make_agent(owner)
    run_enqueue(agent=agent, instruction="a")
    run = run_claim_next(process_id="p")
    run_finish(run=run, status="succeeded", output="ok")

    with pytest.raises(DispatchError) as refused:
        run_cancel(user=owner, run_id=run.pk)

    assert refused.value.code == "CONFLICT"
    assert Run.objects.get(pk=run.pk).status == "succeeded"


def test_it_refuses_to_cancel_another_users_run(owner, outsider, make_agent):
    run = run_enqueue(agent=make_agent(owner), instruction="a")

    with pytest.raises(DispatchError) as refused:
        run_cancel(user=outsider, run_id=run.pk)

    assert refused.value.code == "NOT_FOUND"
    assert Run.objects.get(pk=run.pk).status == "queued"


def test_archiving_an_agent_cancels_its_queued_and_running_runs(owner, make_agent):
    agent = make_agent(owner)
    run_enqueue(agent=agent, instruction="a")
    run_enqueue(agent=agent, instruction="b")
    run_claim_next(process_id="p")

    agent_archive(agent=agent)

    assert set(Run.objects.values_list("status", flat=True)) == {"cancelled"}
    assert run_claim_next(process_id="p") is None


# --- orphans -----------------------------------------------------------------------------


def test_a_run_whose_worker_died_is_failed_and_never_replayed(owner, make_agent):
    agent = make_agent(owner)
    run_enqueue(agent=agent, instruction="rm -rf build && make")
    waiting = run_enqueue(agent=agent, instruction="next")
    orphan = run_claim_next(process_id="proc_dead")

    failed = runs_fail_orphaned(alive_process_ids=["proc_alive"])

    assert [run.pk for run in failed] == [orphan.pk]
    stored = Run.objects.get(pk=orphan.pk)
    assert (stored.status, stored.error) == ("failed", WORKER_LOST)
    assert stored.finished_at is not None
    nxt = run_claim_next(process_id="proc_alive")
    assert nxt.pk == waiting.pk  # the queue moves on; the orphan is not claimed again
    assert Run.objects.get(pk=orphan.pk).status == "failed"
    event = AgentEvent.objects.get(agent=agent, run=orphan)
    assert (event.type, event.message) == ("system", f"run {orphan.pk} failed: worker lost")


def test_runs_of_live_workers_are_not_touched_by_the_orphan_sweep(owner, make_agent):
    agent = make_agent(owner)
    run_enqueue(agent=agent, instruction="a")
    run = run_claim_next(process_id="proc_alive")

    assert runs_fail_orphaned(alive_process_ids=["proc_alive"]) == []
    assert Run.objects.get(pk=run.pk).status == "running"


def test_with_no_live_process_every_running_run_is_orphaned(owner, make_agent):
    agent = make_agent(owner)
    run_enqueue(agent=agent, instruction="a")
    run = run_claim_next(process_id="proc_x")

    runs_fail_orphaned(alive_process_ids=[])

    assert Run.objects.get(pk=run.pk).status == "failed"


def test_the_reaper_fails_the_runs_of_a_dead_process(owner):
    from datetime import timedelta

    from django.utils import timezone

    from agents.models import Run
    from agents.services import agent_create, run_claim_next, run_enqueue
    from core.models import ServerProcess
    from dispatch.background import reap_once

    dead = ServerProcess.objects.create(id="proc_dead", kind="serve", hostname="h", pid=1)
    ServerProcess.objects.filter(pk=dead.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    agent = agent_create(owner=owner, type="expert", name="a", cwd="/tmp")
    run = run_enqueue(agent=agent, instruction="go")
    claimed = run_claim_next(process_id="proc_dead")
    assert claimed is not None and claimed.pk == run.pk
    reap_once()
    run.refresh_from_db()
    assert (run.status, run.error) == (Run.Status.FAILED, "worker lost")
    assert not ServerProcess.objects.filter(pk="proc_dead").exists()
