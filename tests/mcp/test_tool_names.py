"""Remote functions as MCP tool names (docs/mcp.md#tools)."""

from __future__ import annotations

import hashlib

from hypothesis import given
from hypothesis import strategies as st

from core.tools import TOOL_NAME_PATTERN, remote_tool_names, tool_name


def short_hash(full_name: str) -> str:
    return hashlib.sha256(full_name.encode()).hexdigest()[:6]


def test_it_names_a_remote_function_remote_remotename_function() -> None:
    names = remote_tool_names([("weather-service", "get_forecast")])
    assert names == {("weather-service", "get_forecast"): "remote__weather-service__get_forecast"}


def test_it_replaces_characters_model_apis_refuse_with_underscores() -> None:
    assert tool_name("remote__team/weather.v2__get_forecast") == "remote__team_weather_v2__get_forecast"


def test_it_cuts_a_name_over_64_characters_and_ends_it_with_a_hash_of_the_full_name() -> None:
    full = "remote__" + "a" * 60 + "__get_forecast"
    name = tool_name(full)
    assert len(name) == 64
    assert name == full[:57] + "_" + short_hash(full)
    assert TOOL_NAME_PATTERN.fullmatch(name)


def test_it_keeps_a_name_of_exactly_64_characters_as_it_is() -> None:
    full = "remote__" + "b" * 52 + "__fn"
    assert len(full) == 64
    assert tool_name(full) == full


def test_two_remotes_mapping_to_one_name_both_get_the_hash_suffix() -> None:
    names = remote_tool_names([("team.a", "run"), ("team/a", "run"), ("other", "run")])
    first, second = names[("team.a", "run")], names[("team/a", "run")]
    assert first == "remote__team_a__run_" + short_hash("remote__team.a__run")
    assert second == "remote__team_a__run_" + short_hash("remote__team/a__run")
    assert first != second
    assert names[("other", "run")] == "remote__other__run"


def test_long_colliding_names_stay_within_64_characters_and_distinct() -> None:
    long = "x" * 60
    names = remote_tool_names([(f"{long}.a", "f"), (f"{long}/a", "f")])
    assert len(set(names.values())) == 2
    assert all(len(name) == 64 and TOOL_NAME_PATTERN.fullmatch(name) for name in names.values())


remotenames = st.from_regex(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,63}$", fullmatch=True)
functions = st.from_regex(r"^[A-Za-z0-9_-]{1,64}$", fullmatch=True)


@given(st.lists(st.tuples(remotenames, functions), unique=True, max_size=8))
def test_every_remote_function_gets_a_valid_name_of_its_own(pairs: list[tuple[str, str]]) -> None:
    names = remote_tool_names(pairs)
    assert all(TOOL_NAME_PATTERN.fullmatch(name) for name in names.values())
    assert len(set(names.values())) == len(pairs)
