"""The Agents pages: list, launch form, agent page, prompt and archive forms."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.template import engines
from django.test import Client
from django.utils import timezone

from agents import selectors
from agents.models import Agent, AgentMessage, Run
from agents.services import agent_create
from agents.types import parse_agent_types
from agents.views import NESTING_SHOWN, nest_agents
from tests.agents.conftest import force_status
from tests.peers.conftest import FakePeer, make_peer  # noqa: F401 - a fixture used below

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
        parent=parent,
        latest_event_type="blocked",
        latest_event_message="<img src=x onerror=1>" + "y" * 100,
        latest_event_at=timezone.now(),
    )
    for path in ("/", "/agents/fragment"):
        page = browser.get(path).content.decode()
        assert "<script>alert" not in page and "<img" not in page and "p&<i>" not in page
        assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page and "p&amp;&lt;i&gt;" in page
        assert "waiting for approval</span> &lt;img src=x onerror=1&gt;" in page
        assert f'<a href="/agents/{child.pk}/">' in page and f"child of {parent.pk}" in page


# The row markup of templates/agents/_agent_list.html as it was when the template wrote the
# rows (commit 6fc2c0e), kept as the reference AgentRow.html must reproduce.
TEMPLATE_ROWS = """{% for row in rows %}{% with agent=row.agent %}
    <tr data-agent="{{ agent.pk }}" data-depth="{{ row.depth }}" class="{% if agent.peer_agent_id %}shadow{% endif %}{% if agent.stale %} stale{% endif %}{% if row.depth %} nested{% endif %}">
      <td style="--depth: {{ row.indent }}"><span class="agent-name">{% if row.depth %}<span class="nest" aria-hidden="true">↳</span> {% endif %}<a href="{% url 'agent' agent.pk %}">{{ agent.name }}</a>{% if agent.peer_agent_id %} <span class="badge peer-badge" title="a shadow of {{ agent.peer_agent_id }} on a linked instance">{% if agent.peer %}{{ agent.peer.label }}{% else %}unlinked peer{% endif %}</span>{% endif %}</span>{% if agent.parent_id %} <small class="hint">child of {{ agent.parent_id }}</small>{% endif %}</td>
      <td data-label="Type">{{ agent.type }}</td>
      <td data-label="Status"><span class="badge status-{{ agent.status }}">{{ agent.status }}</span>{% if agent.stale %} <span class="badge stale-badge" title="the link to this agent's instance is down: this is its last known state">stale</span>{% endif %}</td>
      <td data-label="Latest event">{% if agent.latest_event_at %}<span class="event-{{ agent.latest_event_type }}">{% if agent.latest_event_type == "blocked" %}waiting for approval{% else %}{{ agent.latest_event_type }}{% endif %}</span> {{ agent.latest_event_message|truncatechars:80 }} <small class="hint">{{ agent.latest_event_at|timesince }} ago</small>{% else %}—{% endif %}</td>
      <td data-label="Created">{{ agent.created_at|date:"Y-m-d H:i" }}</td>
    </tr>
  {% endwith %}{% endfor %}"""  # noqa: E501 - the template's lines as they were


def same_classes(html: str) -> str:
    # The template wrote " stale" for a stale agent that is not a shadow; AgentRow joins
    # the names: the one difference allowed.
    return re.sub(r'class=" ', 'class="', html)


def test_the_lists_rows_are_the_markup_the_template_wrote(
    owner: Any,
    member: Any,
    make_peer: Callable[..., FakePeer],  # noqa: F811 - the fixture imported above
) -> None:
    now = timezone.now()
    created = datetime(2026, 3, 29, 0, 30, tzinfo=UTC)  # Berlin's change to summer time at 01:00 UTC

    def agent(id: str, owner: Any = owner, **fields: Any) -> Agent:
        nonlocal created
        created += timedelta(minutes=7)
        fields = {"name": id, "type": "expert", "status": "running", "cwd": "/srv", **fields}
        return Agent.objects.create(id=id, owner=owner, created_at=created, **fields)

    def latest(type: str, message: str, ago: timedelta) -> dict[str, Any]:
        return {"latest_event_type": type, "latest_event_message": message, "latest_event_at": now - ago}

    long = "<img src=x onerror=1> & " + "y" * 100
    cloud = make_peer(owner, label='<Cloud & "Co">').peer
    elsewhere = agent("agt_elsewhere", owner=member)  # a parent not on this user's page
    # A chain of sub-agents 7 deep, each a branch of the latest-event cell.
    chain = [agent("agt_<&\"'>", name="<b>\"root\"</b> & 'co'", type="ex<p>&\"t'")]
    for depth, (status, event) in enumerate(
        [
            ("creating", latest("blocked", long, timedelta(days=2, hours=3))),
            ("stopping", latest("message", "&" * 80, timedelta(minutes=5))),  # 80: not truncated
            ("stopped", latest("<x>", "z" * 81, timedelta(seconds=20))),  # 81: truncated
            ("error", {}),  # no latest event
            ("running", latest("done", "", timedelta(hours=1))),
            ("running", latest("", "no type", timedelta(days=40))),
            ("stopped", {}),
        ],
        start=1,
    ):
        chain.append(agent(f"agt_chain{depth}", parent=chain[-1], status=status, stale=depth == 1, **event))
    shadow = latest("blocked", "a <b>", timedelta(hours=5))
    agent("agt_shadow", peer=cloud, peer_agent_id="agt_<\"&'>", stale=True, **shadow)
    agent("agt_shadowkid", parent_id="agt_shadow", peer=cloud, peer_agent_id="agt_x", stale=True)
    agent("agt_unlinked", parent=chain[0], peer=None, peer_agent_id="agt_gone", status="stopped")
    agent("agt_unlinked2", peer=None, peer_agent_id="agt_gone2", **latest("started", "hi", timedelta(0)))
    agent("agt_orphan", parent=elsewhere, name="o & <o>")
    agent("agt_stale", stale=True, status="error", **latest("error", long, timedelta(days=400)))
    agent("agt_plain")

    with timezone.override("Europe/Berlin"):
        rows = nest_agents(selectors.agents_for(user=owner).items)  # as the page builds them
        new = [same_classes(row.html) for row in rows]
        template = engines["django"].from_string(TEMPLATE_ROWS)
        old = [same_classes(template.render({"rows": [row]}).strip()) for row in rows]

    assert len(rows) == 15 and sorted({row.depth for row in rows}) == list(range(8))
    deepest = next(html for html in old if 'data-agent="agt_chain7"' in html)
    assert 'data-depth="7"' in deepest and f'style="--depth: {NESTING_SHOWN}"' in deepest  # the indent is capped
    reference = "\n".join(old)
    for branch in (
        'class="shadow stale nested"',
        'class="shadow nested"',
        'class="shadow"',
        'class="stale nested"',
        'class="stale"',
        'class=""',
        "waiting for approval</span> &lt;img src=x onerror=1&gt; &amp; yyy",
        "y…",
        "&amp;" * 80 + " <small",
        "z" * 79 + "…",
        '<span class="event-&lt;x&gt;">&lt;x&gt;</span>',
        '<span class="event-"></span> no type',
        '<td data-label="Latest event">—</td>',
        'instance">&lt;Cloud &amp; &quot;Co&quot;&gt;</span>',
        "a shadow of agt_&lt;&quot;&amp;&#x27;&gt; on",
        ">unlinked peer</span>",
        "child of agt_&lt;&amp;&quot;&#x27;&gt;",
        "child of agt_elsewhere",
        "&lt;b&gt;&quot;root&quot;&lt;/b&gt; &amp; &#x27;co&#x27;",
        "ex&lt;p&gt;&amp;&quot;t&#x27;",
        "2026-03-29 01:",  # before the change
        "2026-03-29 03:",  # after it
    ):
        assert branch in reference, branch  # the samples reach every branch of the row
    assert new == old


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
