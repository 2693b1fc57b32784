"""Redaction of secret-looking values in the shim's audit log (docs/shim-protocol.md#audit)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from machines.shim import AuditLog, redact, redact_argv
from machines.shim.audit import operation_details


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("--password=hunter2", "--password=[REDACTED]"),
        ("mysql --password='s3 cret' db", "mysql --password=[REDACTED] db"),
        ("Authorization: Bearer abc.def", "Authorization: [REDACTED]"),
        ("curl -H 'authorization: token abc' https://x", "curl -H 'authorization: [REDACTED]' https://x"),
        ("https://host/cb?token=abc123&next=/", "https://host/cb?token=[REDACTED]&next=/"),
        ("access_token=abc", "access_token=[REDACTED]"),
        ("AWS_SECRET_ACCESS_KEY=wJalr make", "AWS_SECRET_ACCESS_KEY=[REDACTED] make"),
        ("OPENAI_API_KEY=sk-1 python x.py", "OPENAI_API_KEY=[REDACTED] python x.py"),
        ("CLIENT_SECRET=xyz", "CLIENT_SECRET=[REDACTED]"),
        ("GITHUB_TOKEN=ghp_1 gh pr list", "GITHUB_TOKEN=[REDACTED] gh pr list"),
        ("deploy --token abc --verbose", "deploy --token [REDACTED] --verbose"),
        ("ls -la /home", "ls -la /home"),
        ("tokenizer=bert --sort=name", "tokenizer=bert --sort=name"),
    ],
)
def test_it_redacts_secret_looking_values(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_it_redacts_the_argument_after_a_bare_secret_flag() -> None:
    argv = ["login", "--password", "hunter2", "--user", "al", "-H", "Authorization: Bearer x", "PGPASSWORD=p"]
    assert redact_argv(argv) == [
        "login",
        "--password",
        "[REDACTED]",
        "--user",
        "al",
        "-H",
        "Authorization: [REDACTED]",
        "PGPASSWORD=[REDACTED]",
    ]


def test_it_never_records_contents_or_env_values() -> None:
    details = operation_details(
        "FILE_WRITE", {"path": "a.txt", "content": "private words", "encoding": "utf-8", "append": True}
    )
    assert details == {"path": "a.txt", "encoding": "utf-8", "append": True, "content_chars": 13}
    details = operation_details(
        "EXECUTE_COMMAND", {"command": "make deploy", "cwd": "src", "env": {"DB_URL": "postgres://u:pw@h/db"}}
    )
    assert details == {"command": "make deploy", "cwd": "src", "env_keys": ["DB_URL"]}
    assert "pw@h" not in json.dumps(details)


def test_it_records_nothing_it_cannot_trust() -> None:
    details = operation_details("FILE_READ", {"path": {"nested": "x"}, "offset": "12", "length": 5})
    assert details == {"length": 5}


def test_it_appends_records_to_a_private_file(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "new-dir" / "audit.jsonl")
    for number in range(2):
        log.write(
            session_id="s",
            machine_id="m",
            request_id=f"r{number}",
            op="PING",
            details={},
            ok=True,
            error_code=None,
            duration_ms=1.23456,
        )
    lines = log.path.read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["r0", "r1"]
    assert json.loads(lines[0])["result"] == {"ok": True, "error_code": None, "duration_ms": 1.235}
    assert stat.S_IMODE(log.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(log.path.parent.stat().st_mode) == 0o700


def test_it_records_the_live_options_of_a_command_but_not_its_input() -> None:
    details = operation_details(
        "EXECUTE_COMMAND",
        {"argv": ["sha256sum"], "stream": True, "binary": False, "stdin": "stream", "pipe": True, "data": "x"},
    )
    assert details == {"argv": ["sha256sum"], "stream": True, "binary": False, "stdin": "stream", "pipe": True}


def test_it_adds_cancelled_and_bytes_per_stream_to_the_result(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    log.write(
        session_id="s",
        machine_id="m",
        request_id="r",
        op="EXECUTE_COMMAND",
        details={},
        ok=True,
        error_code=None,
        duration_ms=5,
        exit_code=-15,
        cancelled=True,
        byte_counts={"stdout": 10, "stderr": 0, "stdin": 3},
    )
    (line,) = log.path.read_text().splitlines()
    assert json.loads(line)["result"] == {
        "ok": True,
        "error_code": None,
        "duration_ms": 5,
        "exit_code": -15,
        "cancelled": True,
        "bytes": {"stdout": 10, "stderr": 0, "stdin": 3},
    }
