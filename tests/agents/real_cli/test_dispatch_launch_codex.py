"""Dispatch launches the REAL codex (tests/clients) through ``POST /api/v1/agents`` on a real
``manage.py serve``, against the fake model (a custom provider in a fresh CODEX_HOME's
config.toml), in a never-seen folder (docs/agents.md#folder-trust,
docs/agents.md#what-dispatch-writes): with ``trust_folder`` the first prompt reaches the model and the user's
config.toml keeps what it had; in a folder nobody trusted the launch is refused and
config.toml is left as it was; a codex with no way to reach a model is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tomlkit

from agents.types import DEFAULT_AGENT_TYPES
from tests.agents.fake_model import FakeModel, say
from tests.agents.real_cli.conftest import Run, cli_or_skip
from tests.agents.real_cli.dispatch_fixtures import Dispatch, dispatch_serve  # noqa: F401 - a fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def provider_toml(model: FakeModel) -> str:
    """A user's config.toml naming the fake model as its provider (FINDINGS.md, 3a)."""
    return (
        "# my own codex settings\n"
        'model = "gpt-fake"\n'
        'model_provider = "fake"\n\n'
        "[model_providers.fake]\n"
        'name = "fake"\n'
        f'base_url = "{model.url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "FAKE_MODEL_API_KEY"\n'
    )


def codex_type(run: Run, **env: str) -> dict[str, Any]:
    codex = cli_or_skip("codex")
    default = DEFAULT_AGENT_TYPES["codex"]
    return {
        **default,
        "argv": [codex, *default["argv"][1:]],
        "full_access_argv": [codex, *default["full_access_argv"][1:]],
        "env": {"HOME": str(run.home), "CODEX_HOME": str(run.home / ".codex"), **env},
    }


@pytest.fixture
def codex_home(run: Run, fake_model: FakeModel) -> Path:
    home = run.home / ".codex"
    home.mkdir()
    (home / "config.toml").write_text(provider_toml(fake_model))
    return home


@pytest.fixture
def codex_dispatch(
    run: Run,
    codex_home: Path,
    dispatch_serve: Callable[[dict[str, Any]], Dispatch],  # noqa: F811 - the fixture imported above
) -> Iterator[Dispatch]:
    yield dispatch_serve({"codex": codex_type(run, FAKE_MODEL_API_KEY="fake-key")})


def test_dispatch_launches_codex_in_a_never_seen_folder_it_trusts_and_the_prompt_reaches_the_model(
    codex_dispatch: Dispatch, codex_home: Path, fake_model: FakeModel, run: Run
) -> None:
    prompt = f"hello codex from dispatch marker-{run.workdir.name}"
    fake_model.queue(say("pong from codex"))

    launched = codex_dispatch.launch(type="codex", name="cx", cwd=str(run.workdir), prompt=prompt, trust_folder=True)

    assert launched.status_code == 201, launched.text
    agent_id = launched.json()["id"]
    codex_dispatch.wait_running(agent_id)
    try:
        request = fake_model.wait_for(lambda: fake_model.prompts_containing(prompt), timeout=25)[0]
    except TimeoutError:
        log = codex_dispatch.server.log()[-3000:]
        pytest.fail(f"no prompt at the model; {codex_dispatch.agent(agent_id)}\n{codex_dispatch.pane(agent_id)}\n{log}")
    assert request.path == "/v1/responses"
    text = (codex_home / "config.toml").read_text()
    assert text.startswith(provider_toml(fake_model))  # the user's file kept as it was
    assert tomlkit.parse(text)["projects"][str(run.workdir)]["trust_level"] == "trusted"
    assert not (codex_home / "hooks.json").exists()  # the hooks are on the command line only


def test_codex_in_a_folder_nobody_trusted_is_refused_and_config_toml_is_untouched(
    codex_dispatch: Dispatch, codex_home: Path, fake_model: FakeModel, run: Run
) -> None:
    before = (codex_home / "config.toml").read_bytes()

    refused = codex_dispatch.launch(type="codex", name="cx", cwd=str(run.workdir), prompt="hi")

    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "FOLDER_NOT_TRUSTED"
    assert (codex_home / "config.toml").read_bytes() == before
    assert sorted(path.name for path in codex_home.iterdir()) == ["config.toml"]
    assert fake_model.received("/v1/responses") == []


def test_codex_with_no_way_to_reach_a_model_is_refused_saying_so(
    run: Run,
    dispatch_serve: Callable[[dict[str, Any]], Dispatch],  # noqa: F811 - the fixture imported above
) -> None:
    dispatch = dispatch_serve({"codex": codex_type(run)})  # no auth.json, no key, no provider

    refused = dispatch.launch(type="codex", name="cx", cwd=str(run.workdir), prompt="hi", trust_folder=True)

    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert "codex cannot reach a model" in message and "codex login" in message
    assert dispatch.server.get("/api/v1/agents", dispatch.token).json()["agents"] == []
