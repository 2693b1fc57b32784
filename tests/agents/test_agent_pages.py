"""The Agents pages: list, launch form, agent page, prompt and archive forms."""

from __future__ import annotations

import pytest
from django.test import Client
from django.utils import timezone

from agents.models import Agent, AgentMessage, Run
from agents.services import agent_create
from agents.types import parse_agent_types
from tests.agents.conftest import force_status

pytestmark = pytest.mark.django_db


@pytest.fixture
def browser(owner) -> Client:
    client = Client()
    client.force_login(owner)
    return client


def test_the_list_shows_only_the_users_agents(browser, owner, member, tmp_path):
    agent_create(owner=owner, type="expert", name="mine", cwd=str(tmp_path))
    agent_create(owner=member, type="expert", name="theirs", cwd=str(tmp_path))
    page = browser.get("/").content.decode()
    assert "mine" in page and "theirs" not in page
    fragment = browser.get("/agents/fragment").content.decode()
    assert "mine" in fragment and "<html" not in fragment


def test_the_list_escapes_every_value_of_a_row(browser, owner, tmp_path):
    # The list's rows are written in Python for speed (agents.views.AgentRow.html), not
    # by the template's autoescape: a name, event or parent id must still come out as text.
    parent = agent_create(owner=owner, type="expert", name="p&<i>", cwd=str(tmp_path))
    child = agent_create(owner=owner, type="expert", name='<script>alert("x")</script>', cwd=str(tmp_path))
    Agent.objects.filter(pk=child.pk).update(
        parent=parent, latest_event_type="blocked",
        latest_event_message="<img src=x onerror=1>" + "y" * 100,
        latest_event_at=timezone.now(),
    )
    for path in ("/", "/agents/fragment"):
        page = browser.get(path).content.decode()
        assert "<script>alert" not in page and "<img" not in page and "p&<i>" not in page
        assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page and "p&amp;&lt;i&gt;" in page
        assert "waiting for approval</span> &lt;img src=x onerror=1&gt;" in page
        assert f'<a href="/agents/{child.pk}/">' in page and f"child of {parent.pk}" in page


def test_the_launch_form_creates_an_expert_agent_with_its_first_prompt(browser, owner, tmp_path):
    response = browser.post("/", {"type": "expert", "name": "researcher", "cwd": str(tmp_path), "prompt": "hello"})
    agent = Agent.objects.get(owner=owner, name="researcher")
    assert response.status_code == 302 and response["Location"] == f"/agents/{agent.pk}/"
    assert list(Run.objects.filter(agent=agent).values_list("input", flat=True)) == [
        {"instruction": "hello", "input": None}
    ]


def test_the_launch_form_shows_what_was_wrong_and_creates_nothing(browser, owner, tmp_path):
    response = browser.post("/", {"type": "expert", "name": "x", "cwd": str(tmp_path / "missing")})
    assert response.status_code == 400
    assert not Agent.objects.filter(owner=owner).exists()
    response = browser.post("/", {"type": "nope", "name": "x", "cwd": str(tmp_path)})
    assert response.status_code == 400 and "unknown agent type &#x27;nope&#x27;" in response.content.decode()


def test_the_agent_page_is_404_for_another_users_agent(browser, member, tmp_path):
    theirs = agent_create(owner=member, type="expert", name="theirs", cwd=str(tmp_path))
    assert browser.get(f"/agents/{theirs.pk}/").status_code == 404
    assert browser.get(f"/agents/{theirs.pk}/fragment").status_code == 404
    browser.post(f"/agents/{theirs.pk}/prompt", {"instruction": "x"})
    browser.post(f"/agents/{theirs.pk}/archive")
    theirs.refresh_from_db()
    assert theirs.status == "running" and not Run.objects.filter(agent=theirs).exists()


def test_the_prompt_and_archive_forms_act_on_the_users_agent(browser, owner, tmp_path):
    agent = agent_create(owner=owner, type="expert", name="r", cwd=str(tmp_path))
    page = browser.get(f"/agents/{agent.pk}/").content.decode()
    assert agent.pk in page and "Prompt" in page
    browser.post(f"/agents/{agent.pk}/prompt", {"instruction": "summarise"})
    assert Run.objects.get(agent=agent).input["instruction"] == "summarise"
    assert browser.post(f"/agents/{agent.pk}/archive").status_code == 302
    agent.refresh_from_db()
    assert agent.status == "archived"


def test_the_launch_form_lists_every_type_and_disables_missing_ones(browser, settings):
    settings.AGENT_TYPES = parse_agent_types(
        {"ghost": {"argv": ["no-such-program-here"], "kind": "llm"}, "shell": {"argv": ["bash"], "kind": "shell"}}
    )
    settings.DEFAULT_CWD = "/srv/default-cwd"
    settings.LLM_BASE_URL = "http://127.0.0.1:9/v1"

    page = browser.get("/").content.decode()

    assert '<option value="expert" data-kind="expert" selected>expert</option>' in page
    assert '<option value="shell" data-kind="shell" >shell</option>' in page
    assert (
        '<option value="ghost" data-kind="llm" disabled>ghost (not installed here: no-such-program-here not on PATH)'
        "</option>" in page
    )
    assert 'value="/srv/default-cwd"' in page and 'name="full_access"' in page


def test_without_a_model_endpoint_the_form_disables_expert_with_why_and_preselects_no_shell(browser, settings):
    settings.AGENT_TYPES = parse_agent_types({"shell": {"argv": ["bash"], "kind": "shell"}})
    settings.LLM_BASE_URL = ""

    page = browser.get("/").content.decode()

    assert (
        '<option value="expert" data-kind="expert" disabled>'
        "expert (no model endpoint configured (set DISPATCH_LLM_BASE_URL))</option>" in page
    )
    assert '<option value="" disabled selected>choose a type</option>' in page
    assert '<option value="shell" data-kind="shell" >shell</option>' in page  # offered, not chosen
    assert '<select name="type" id="launch-type" required>' in page


def test_the_launch_form_preselects_the_first_installed_llm_cli_without_an_endpoint(browser, settings):
    settings.AGENT_TYPES = parse_agent_types(
        {"shell": {"argv": ["bash"], "kind": "shell"}, "fake-llm": {"argv": ["true"], "kind": "llm"}}
    )
    settings.LLM_BASE_URL = ""

    page = browser.get("/").content.decode()

    assert '<option value="fake-llm" data-kind="llm" selected>fake-llm</option>' in page
    assert '<option value="" disabled >choose a type</option>' in page


def test_the_launch_form_without_a_type_and_no_default_says_which_types_exist(browser, owner, tmp_path, settings):
    settings.AGENT_TYPES = parse_agent_types({"shell": {"argv": ["bash"], "kind": "shell"}})
    settings.LLM_BASE_URL = ""

    response = browser.post("/", {"type": "", "name": "helper", "cwd": str(tmp_path), "prompt": "summarise"})

    assert response.status_code == 400
    assert "type is required" in response.content.decode() and "available types: shell" in response.content.decode()
    assert not Agent.objects.exists()


def test_the_launch_form_refuses_a_missing_program(browser, owner, tmp_path, settings):
    settings.AGENT_TYPES = parse_agent_types({"ghost": {"argv": ["no-such-program-here"], "kind": "llm"}})

    response = browser.post("/", {"type": "ghost", "name": "g", "cwd": str(tmp_path)})

    assert response.status_code == 400
    assert "its program is not on PATH" in response.content.decode()
    assert not Agent.objects.exists()


def test_a_local_cli_agents_page_has_the_pane_the_message_box_and_stop(browser, owner, tmp_path):
    agent = force_status(agent_create(owner=owner, type="shell", name="sh", cwd=str(tmp_path)), "running")

    page = browser.get(f"/agents/{agent.pk}/").content.decode()

    assert f'data-pane-agent="{agent.pk}"' in page
    assert 'id="message-form"' in page and 'id="stop"' in page and 'id="start"' not in page
    assert "No messages yet." in page and "Runs" not in page


def test_a_cli_agent_of_another_host_has_no_pane_view(browser, owner, tmp_path):
    agent = force_status(agent_create(owner=owner, type="shell", name="sh", cwd=str(tmp_path)), "running")
    Agent.objects.filter(pk=agent.pk).update(host="elsewhere")

    page = browser.get(f"/agents/{agent.pk}/").content.decode()

    assert "data-pane-agent" not in page and "runs on host <code>elsewhere</code>" in page


def test_the_message_box_sends_a_message_that_shows_queued(browser, owner, member, tmp_path):
    agent = force_status(agent_create(owner=owner, type="shell", name="sh", cwd=str(tmp_path)), "running")
    theirs = force_status(agent_create(owner=member, type="shell", name="t", cwd=str(tmp_path)), "running")

    response = browser.post(f"/agents/{agent.pk}/message", {"content": "echo hi"})
    browser.post(f"/agents/{theirs.pk}/message", {"content": "intrusion"})

    assert response.status_code == 302
    message = AgentMessage.objects.get()
    assert (message.recipient_agent_id, message.content, message.status) == (agent.pk, "echo hi", "queued")
    fragment = browser.get(f"/agents/{agent.pk}/fragment").content.decode()
    assert "echo hi" in fragment and "message-queued" in fragment


def test_stop_and_start_forms_move_an_expert_agent(browser, owner, tmp_path):
    agent = agent_create(owner=owner, type="expert", name="e", cwd=str(tmp_path))

    browser.post(f"/agents/{agent.pk}/stop")
    agent.refresh_from_db()
    assert agent.status == "stopped"
    page = browser.get(f"/agents/{agent.pk}/").content.decode()
    assert 'id="start"' in page and 'id="prompt"' not in page

    browser.post(f"/agents/{agent.pk}/start")
    agent.refresh_from_db()
    assert agent.status == "running"


def test_the_prompt_form_enables_the_ticked_remotes(browser, owner, tmp_path):
    agent = agent_create(owner=owner, type="expert", name="e", cwd=str(tmp_path))

    page = browser.get(f"/agents/{agent.pk}/").content.decode()
    browser.post(f"/agents/{agent.pk}/prompt", {"instruction": "forecast", "remotes": ["weather", "repo"]})

    assert "No remotes connected." in page
    assert Run.objects.get(agent=agent).input == {
        "instruction": "forecast",
        "input": None,
        "remotes": ["weather", "repo"],
    }
