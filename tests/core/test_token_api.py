"""``POST /api/v1/auth/token`` and bearer authentication on the REST API (docs/ws-protocol.md#authentication)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from core.models import ApiToken

pytestmark = [pytest.mark.django_db, pytest.mark.smoke]

PASSWORD = "correct horse battery"
TOKEN_URL = "/api/v1/auth/token"
REMOTES_URL = "/api/v1/remotes"


def obtain(client: Client, username: str = "alice", password: object = PASSWORD, **extra: object):
    return client.post(
        TOKEN_URL, {"username": username, "password": password, **extra}, content_type="application/json"
    )


def assert_error_shape(response, code: str) -> None:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_it_issues_a_token_that_works_as_a_bearer_token(owner):
    client = Client()
    response = obtain(client, name="script")
    assert response.status_code == 201
    token = response.json()["token"]
    assert response.json()["name"] == "script"
    assert ApiToken.objects.get(user=owner).prefix == token[:8]

    listed = Client().get(REMOTES_URL, headers={"Authorization": f"Bearer {token}"})
    assert listed.status_code == 200
    assert listed.json() == {"remotes": []}


def test_it_answers_401_for_a_wrong_password_in_the_error_shape(owner):
    response = obtain(Client(), password="wrong")
    assert response.status_code == 401
    assert_error_shape(response, "AUTHENTICATION_FAILED")
    assert response["WWW-Authenticate"] == "Bearer"
    assert ApiToken.objects.count() == 0


def test_an_unknown_user_gets_the_same_answer_as_a_wrong_password(owner):
    unknown = obtain(Client(), username="nobody")
    wrong = obtain(Client(), password="wrong")
    assert unknown.status_code == wrong.status_code == 401
    assert unknown.json() == wrong.json()


def test_it_answers_429_after_five_failures_even_with_the_right_password(owner):
    client = Client()
    for _ in range(5):
        assert obtain(client, password="wrong").status_code == 401
    response = obtain(client)
    assert response.status_code == 429
    assert_error_shape(response, "RATE_LIMITED")
    assert response.json()["error"]["message"] == "too many failed attempts; try again later"
    assert ApiToken.objects.count() == 0


def test_it_throttles_a_client_address_across_usernames(owner):
    for index in range(5):
        assert obtain(Client(), username=f"guess{index}", password="wrong").status_code == 401
    assert obtain(Client(REMOTE_ADDR="127.0.0.1")).status_code == 429
    # Another address is not throttled.
    assert obtain(Client(REMOTE_ADDR="10.0.0.9")).status_code == 201


@pytest.mark.parametrize(
    "body",
    [{"username": "alice"}, {"password": PASSWORD}, {}, {"username": "alice", "password": ""}],
    ids=["no-password", "no-username", "empty", "blank-password"],
)
def test_it_answers_400_for_missing_fields_in_the_error_shape(owner, body):
    response = Client().post(TOKEN_URL, body, content_type="application/json")
    assert response.status_code == 400
    assert_error_shape(response, "VALIDATION_ERROR")
    assert ApiToken.objects.count() == 0


def test_it_answers_400_for_a_body_that_is_not_json(owner):
    response = Client().post(TOKEN_URL, "{not json", content_type="application/json")
    assert response.status_code == 400
    assert_error_shape(response, "INVALID_REQUEST")


def test_the_api_answers_401_with_www_authenticate_without_a_token():
    response = Client().get(REMOTES_URL)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"
    assert_error_shape(response, "NOT_AUTHENTICATED")


@pytest.mark.parametrize("header", ["Bearer nope", "Bearer", "Bearer a b"])
def test_the_api_answers_401_for_a_bad_bearer_token(owner, header):
    response = Client().get(REMOTES_URL, headers={"Authorization": header})
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"
    assert_error_shape(response, "AUTHENTICATION_FAILED")


def test_the_login_page_is_throttled_after_five_failures(owner):
    client = Client()
    for _ in range(5):
        response = client.post("/login/", {"username": "alice", "password": "wrong"})
        assert response.status_code == 200
        assert "_auth_user_id" not in client.session
    response = client.post("/login/", {"username": "alice", "password": PASSWORD})
    assert response.status_code == 429
    assert "too many failed attempts" in response.content.decode()
    assert "_auth_user_id" not in client.session


def test_the_login_page_logs_in_with_the_right_password(owner):
    client = Client()
    response = client.post("/login/", {"username": "alice", "password": PASSWORD})
    assert response.status_code == 302
    assert client.session["_auth_user_id"] == str(owner.pk)


def test_the_openapi_schema_describes_the_async_routes_too(client, owner):
    client.force_login(owner)
    response = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    for path in (
        "/api/v1/remotes/{remotename}/call",
        "/api/v1/sessions/{session_id}/ops",
        "/api/v1/sessions/{session_id}/copy",
        "/api/v1/machines/device/code",
        "/api/v1/machines/device/token",
    ):
        assert "post" in paths[path], path


def test_the_schema_describes_the_event_stream(client, owner_token):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json", HTTP_AUTHORIZATION=f"Bearer {owner_token}")
    stream = schema.json()["paths"]["/api/v1/events"]["get"]
    assert [parameter["name"] for parameter in stream["parameters"]] == ["pane"]


def test_the_schema_and_swagger_ui_need_a_login_or_a_token(client, owner_token):
    assert client.get("/api/schema/").status_code == 401
    assert client.get("/api/docs/").status_code == 302  # a browser without a session: to the login page
    assert client.get("/api/docs/", HTTP_AUTHORIZATION="Bearer nope").status_code == 401
    assert client.get("/api/schema/", HTTP_AUTHORIZATION=f"Bearer {owner_token}").status_code == 200


def test_an_issued_token_answers_its_fields_in_order_with_times_in_utc(owner):
    # The answer's JSON, byte for byte as DRF's serializer wrote it: the secret first, an
    # expiry sent with an offset (or none) in UTC with its microseconds, "Z".
    response = obtain(Client(), name=" pad ", expires_at="2031-01-02T03:04:05.123456+02:00")
    assert response.status_code == 201
    token = ApiToken.objects.get()
    created = token.created_at.isoformat().replace("+00:00", "Z")
    assert response.content.decode() == (
        f'{{"token":"{response.json()["token"]}","id":{token.pk},"name":"pad","prefix":"{token.prefix}",'
        f'"created_at":"{created}","last_used_at":null,"expires_at":"2031-01-02T01:04:05.123456Z","revoked_at":null}}'
    )
    naive = obtain(Client(), expires_at="2031-01-02T03:04:05")
    assert naive.json()["expires_at"] == "2031-01-02T03:04:05Z"


@pytest.mark.parametrize(
    ("body", "details"),
    [
        ({"username": None, "password": "x"}, {"username": ["This field may not be null."]}),
        ({"username": ["alice"], "password": "x"}, {"username": ["Not a valid string."]}),
        ({"username": "a\x00", "password": "x"}, {"username": ["Null characters are not allowed."]}),
        (
            {"username": "alice", "password": "x" * 4097},
            {"password": ["Ensure this field has no more than 4096 characters."]},
        ),
        ({"username": "alice", "password": "x", "name": None}, {"name": ["This field may not be null."]}),
        (
            {"username": "alice", "password": "x", "expires_at": 5},
            {
                "expires_at": [
                    "Datetime has wrong format. Use one of these formats instead: "
                    "YYYY-MM-DDThh:mm[:ss[.uuuuuu]][+HH:MM|-HH:MM|Z]."
                ]
            },
        ),
    ],
)
def test_a_refused_body_names_the_field_and_its_reason(owner, body, details):
    response = Client().post(TOKEN_URL, body, content_type="application/json")
    assert response.status_code == 400
    field, [sentence] = next(iter(details.items()))
    assert response.json() == {
        "error": {"code": "VALIDATION_ERROR", "message": f"{field}: {sentence}", "details": details}
    }


def test_a_password_sent_as_a_number_is_read_as_its_text(owner):
    # core.api.TokenCredentials coerces a JSON number to its text, as DRF's CharField did:
    # the number 12345 is the password "12345", whether sent as a number or a string.
    dave = get_user_model().objects.create_user("dave", password="12345")
    for password in (12345, "12345"):
        response = obtain(Client(), username="dave", password=password, name=f"sent as {type(password).__name__}")
        assert response.status_code == 201, (password, response.content)
        token = response.json()["token"]
        listed = Client().get(REMOTES_URL, headers={"Authorization": f"Bearer {token}"})
        assert listed.status_code == 200, password
    assert sorted(ApiToken.objects.filter(user=dave).values_list("name", flat=True)) == ["sent as int", "sent as str"]
    # Read as text, not as a number: 12345.0 is the text "12345.0", the wrong password.
    wrong = obtain(Client(), username="dave", password=12345.0)
    assert wrong.status_code == 401
    assert_error_shape(wrong, "AUTHENTICATION_FAILED")
    assert ApiToken.objects.filter(user=dave).count() == 2
