"""Command-line parsing details of the remote client."""

from __future__ import annotations

from remotes.client import cli


def test_it_accepts_a_token_that_starts_with_a_dash() -> None:
    assert cli._join_option_values(["call", "r", "f", "{}", "--token", "-abc", "--url", "ws://x/ws"]) == [
        "call",
        "r",
        "f",
        "{}",
        "--token=-abc",
        "--url=ws://x/ws",
    ]
    args = cli._parser().parse_args(cli._join_option_values(["call", "r", "f", "{}", "--token", "-abc"]))
    assert args.token == "-abc"
