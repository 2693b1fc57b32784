"""The Agents pages: list, launch form, agent page, prompt and archive forms (ui.md)."""

from __future__ import annotations

import pytest
from django.test import Client

from dispatch.agents.services import agent_create
from dispatch.models import Agent, Run

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
