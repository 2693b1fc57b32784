"""The Remotes page: the user's own remotes, the polled list, and the call form
(docs/ws-protocol.md#remote-call)."""

from __future__ import annotations

import asyncio
import html
import json
import re
import uuid

import pytest
from asgiref.sync import ThreadSensitiveContext
from django.conf import settings
from django.test import AsyncClient

from remotes.protocol import FunctionSpec
from remotes.services import remote_connect, ws_session_open

WEATHER = "weather-service"
HTMX = {"HX-Request": "true", "HX-Current-URL": "http://testserver/remotes/"}
VERSION = re.compile(r'id="remote-list-version" value="([0-9a-f]+)"')


def text_of(response) -> str:
    return html.unescape(response.content.decode())


def connect_remote(user, name: str, tools: list[dict]) -> None:
    """A remote row as a ws session would register it (no socket needed to list it)."""
    channel = f"test.{uuid.uuid4().hex}"
    session = ws_session_open(user=user, channel_name=channel, auth_method="token")
    remote_connect(
        user=user,
        ws_session_id=session.pk,
        channel_name=channel,
        remotename=name,
        tools=[FunctionSpec(**tool) for tool in tools],
    )


def version_of(response) -> str:
    match = VERSION.search(response.content.decode())
    assert match, "the list carries no version"
    return match.group(1)


@pytest.fixture
def alice_client(client, owner):
    client.force_login(owner)
    return client


# --- the list ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_it_shows_an_empty_state_with_the_command_to_serve_a_remote(alice_client):
    response = alice_client.get("/remotes/")
    assert response.status_code == 200
    page = text_of(response)
    assert 'id="no-remotes"' in page
    assert "No remotes connected." in page
    assert f"dispatch-remote serve weather.py:remote --server {settings.PUBLIC_URL} --token $DISPATCH_TOKEN" in page
    assert "— no remote connected —" in page


@pytest.mark.django_db
def test_it_lists_the_users_remotes_with_their_functions(alice_client, owner, weather_tools):
    connect_remote(owner, WEATHER, weather_tools)
    page = text_of(alice_client.get("/remotes/"))
    assert f'data-remote="{WEATHER}"' in page
    assert 'data-function="get_forecast"' in page
    assert "Retrieve weather forecast for a location." in page
    assert "served by ws session" in page
    assert '<code>city</code> <span class="type">string</span> <span class="req">required</span>: the city' in page
    assert f'<option value="{WEATHER}/get_forecast">' in page
    assert 'id="no-remotes"' not in page


@pytest.mark.django_db
def test_it_lists_only_the_users_own_remotes(alice_client, owner, member, weather_tools):
    connect_remote(owner, WEATHER, weather_tools)
    connect_remote(member, "bobs-remote", [{"name": "bobs_secret", "description": "bob only"}])
    page = text_of(alice_client.get("/remotes/"))
    assert f'data-remote="{WEATHER}"' in page
    assert "bobs-remote" not in page
    assert "bobs_secret" not in page

    fragment = text_of(alice_client.get("/remotes/fragment", headers=HTMX))
    assert f'data-remote="{WEATHER}"' in fragment
    assert "bobs-remote" not in fragment


@pytest.mark.django_db
def test_the_preselected_function_is_selected_in_the_call_form(alice_client, owner, weather_tools):
    connect_remote(owner, WEATHER, weather_tools)
    page = alice_client.get("/remotes/", {"target": f"{WEATHER}/get_forecast"}).content.decode()
    assert f'<option value="{WEATHER}/get_forecast" selected>' in page


# --- the polled fragment ------------------------------------------------------------------


@pytest.mark.django_db
def test_the_fragment_returns_the_list_and_the_form_choices_out_of_band(alice_client, owner, weather_tools):
    connect_remote(owner, WEATHER, weather_tools)
    response = alice_client.get("/remotes/fragment", headers=HTMX)
    assert response.status_code == 200
    fragment = response.content.decode()
    assert f'data-remote="{WEATHER}"' in fragment
    assert '<select hx-swap-oob="innerHTML:#call-target">' in fragment
    assert f'<option value="{WEATHER}/get_forecast">' in fragment
    assert "<html" not in fragment


@pytest.mark.django_db
def test_the_fragment_keeps_the_users_choice_selected(alice_client, owner, weather_tools):
    connect_remote(owner, WEATHER, weather_tools)
    response = alice_client.get(
        "/remotes/fragment", {"target": f"{WEATHER}/get_forecast", "version": "stale"}, headers=HTMX
    )
    assert f'<option value="{WEATHER}/get_forecast" selected>' in response.content.decode()


@pytest.mark.django_db
def test_the_fragment_answers_204_while_the_list_is_unchanged(alice_client, owner, weather_tools):
    connect_remote(owner, WEATHER, weather_tools)
    version = version_of(alice_client.get("/remotes/"))
    unchanged = alice_client.get("/remotes/fragment", {"version": version}, headers=HTMX)
    assert unchanged.status_code == 204
    assert unchanged.content == b""

    connect_remote(owner, "clock", [{"name": "now", "description": "the time"}])
    changed = alice_client.get("/remotes/fragment", {"version": version}, headers=HTMX)
    assert changed.status_code == 200
    assert 'data-remote="clock"' in changed.content.decode()
    assert version_of(changed) != version


@pytest.mark.django_db
def test_the_fragment_shows_the_empty_state_when_the_last_remote_goes(alice_client, owner, weather_tools):
    from remotes.services import remote_disconnect

    connect_remote(owner, WEATHER, weather_tools)
    version = version_of(alice_client.get("/remotes/"))
    remote_disconnect(user=owner, remotename=WEATHER)
    fragment = text_of(alice_client.get("/remotes/fragment", {"version": version}, headers=HTMX))
    assert 'id="no-remotes"' in fragment
    assert WEATHER not in fragment


# --- the call form ----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_call_form_reports_a_remote_that_is_not_connected(alice_client):
    response = alice_client.post("/remotes/call", {"target": "x/get_forecast", "args": "{}"}, headers=HTMX)
    assert response.status_code == 200
    assert 'id="call-error"' in response.content.decode()
    assert "no connected remote named 'x'" in text_of(response)


@pytest.mark.django_db(transaction=True)
def test_the_call_form_refuses_arguments_that_are_not_json(alice_client, owner, weather_tools):
    connect_remote(owner, WEATHER, weather_tools)
    response = alice_client.post(
        "/remotes/call", {"target": f"{WEATHER}/get_forecast", "args": "{city: Rome"}, headers=HTMX
    )
    assert 'id="call-error"' in response.content.decode()
    assert "args is not valid JSON" in text_of(response)


@pytest.mark.django_db(transaction=True)
def test_the_call_form_refuses_arguments_that_are_not_an_object(alice_client, owner, weather_tools):
    connect_remote(owner, WEATHER, weather_tools)
    response = alice_client.post(
        "/remotes/call", {"target": f"{WEATHER}/get_forecast", "args": '["Rome"]'}, headers=HTMX
    )
    assert "args must be a JSON object" in text_of(response)


@pytest.mark.django_db(transaction=True)
def test_the_call_form_refuses_arguments_that_fail_the_schema(alice_client, owner, weather_tools):
    connect_remote(owner, WEATHER, weather_tools)
    response = alice_client.post("/remotes/call", {"target": f"{WEATHER}/get_forecast", "args": "{}"}, headers=HTMX)
    assert f"invalid arguments for '{WEATHER}.get_forecast': 'city' is a required property" in text_of(response)


@pytest.mark.django_db(transaction=True)
def test_the_call_form_asks_for_a_function(alice_client):
    response = alice_client.post("/remotes/call", {"target": "", "args": "{}"}, headers=HTMX)
    assert "choose a function to call" in text_of(response)


@pytest.mark.django_db(transaction=True)
def test_the_call_form_cannot_reach_another_users_remote(client, owner, member, weather_tools):
    connect_remote(owner, WEATHER, weather_tools)
    client.force_login(member)
    response = client.post(
        "/remotes/call", {"target": f"{WEATHER}/get_forecast", "args": '{"city": "Rome"}'}, headers=HTMX
    )
    assert f"no connected remote named '{WEATHER}'" in text_of(response)


@pytest.mark.django_db(transaction=True)
def test_the_call_form_without_javascript_answers_with_the_whole_page(alice_client, owner, weather_tools):
    connect_remote(owner, WEATHER, weather_tools)
    response = alice_client.post("/remotes/call", {"target": f"{WEATHER}/nope", "args": '{"city": "Rome"}'})
    assert response.status_code == 400
    page = text_of(response)
    assert "<html" in page
    assert f"remote '{WEATHER}' has no function 'nope'" in page
    assert '{"city": "Rome"}</textarea>' in page  # the arguments typed are kept


async def serve_one_call(ws, result=None, error=None) -> dict:
    """Answer the next remote-call event on ``ws``; return that event."""
    event = await ws.next_event(timeout=5)
    assert event["action"] == "remote-call"
    reply = {"action": "remote-call-result", "requestId": event["requestId"]}
    reply |= {"error": error} if error is not None else {"result": result}
    await ws.send(reply)
    return event


async def logged_in_async_client(user) -> AsyncClient:
    client = AsyncClient()
    await client.aforce_login(user)
    return client


async def post_form(client: AsyncClient, form: dict, **kwargs):
    """POST the call form as the ASGI server would run it.

    Django's ``ASGIHandler`` gives each request its own ``ThreadSensitiveContext`` (so the
    request's sync middleware does not hold the process's shared sync thread while the view
    waits); the test client does not, and the serving consumer would wait behind it.
    """
    async with ThreadSensitiveContext():
        return await client.post("/remotes/call", form, **kwargs)


@pytest.mark.django_db(transaction=True)
async def test_the_call_form_runs_a_real_call_and_shows_the_result(ws_connect, owner, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as remote:
        assert (await remote.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}))[
            "message"
        ] == "remote connected"
        client = await logged_in_async_client(owner)
        form = {"target": f"{WEATHER}/get_forecast", "args": '{"city": "Rome"}'}
        posted = asyncio.create_task(post_form(client, form, headers=HTMX))
        event = await serve_one_call(remote, result={"city": "Rome", "forecast": "sunny", "temperature_c": 21})
        response = await posted
    assert event["function"] == "get_forecast"
    assert event["args"] == {"city": "Rome"}
    assert response.status_code == 200
    body = response.content.decode()
    assert 'id="call-output"' in body
    shown = json.loads(html.unescape(re.search(r'<pre class="result">(.*?)</pre>', body, re.S).group(1)))
    assert shown == {"city": "Rome", "forecast": "sunny", "temperature_c": 21}


@pytest.mark.django_db(transaction=True)
async def test_the_call_form_shows_the_error_the_remote_reported(ws_connect, owner, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as remote:
        await remote.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        client = await logged_in_async_client(owner)
        form = {"target": f"{WEATHER}/get_forecast", "args": '{"city": "Atlantis"}'}
        posted = asyncio.create_task(post_form(client, form, headers=HTMX))
        await serve_one_call(remote, error="ValueError: no such city")
        response = await posted
    assert 'id="call-error"' in response.content.decode()
    assert "ValueError: no such city" in text_of(response)


@pytest.mark.django_db(transaction=True)
async def test_the_call_form_without_javascript_shows_the_result_in_the_page(
    ws_connect, owner, owner_token, weather_tools
):
    async with ws_connect(token=owner_token) as remote:
        await remote.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        client = await logged_in_async_client(owner)
        form = {"target": f"{WEATHER}/get_forecast", "args": '{"city": "Rome"}'}
        posted = asyncio.create_task(post_form(client, form))
        await serve_one_call(remote, result={"city": "Rome"})
        response = await posted
    assert response.status_code == 200
    page = response.content.decode()
    assert "<html" in page
    assert 'id="call-output"' in page
    assert f'<option value="{WEATHER}/get_forecast" selected>' in page
