"""One redaction for both audits: the shim's log and the platform's ``AuditRecord``
(docs/shim-protocol.md#audit). Each row is a command line with a secret in it;
both audits must hide the secret and keep the rest."""

from __future__ import annotations

import shlex
from typing import Any

import pytest

from machines.services.audit import audit_details
from machines.shim.audit import operation_details

R = "[REDACTED]"

# (command string, the secret that must not survive, the command as recorded)
ROWS: list[tuple[str, str, str]] = [
    (
        "git clone https://alice:hunter2@git.example/repo.git",
        "hunter2",
        f"git clone https://alice:{R}@git.example/repo.git",
    ),
    ("psql postgres://app:pg-pass-1@db:5432/app", "pg-pass-1", f"psql postgres://app:{R}@db:5432/app"),
    ("curl -u alice:s3cret https://api.example", "s3cret", f"curl -u alice:{R} https://api.example"),
    ("curl --user alice:s3cret2 https://api.example", "s3cret2", f"curl --user alice:{R} https://api.example"),
    ("curl -ualice:s3cret3 https://api.example", "s3cret3", f"curl -ualice:{R} https://api.example"),
    ("http GET api.example 'Authorization=Bearer tok-9'", "tok-9", f"http GET api.example 'Authorization={R}'"),
    ("env Authorization=abc123 ./run", "abc123", f"env Authorization={R} ./run"),
    ("curl -H 'Authorization: Bearer br-0004' https://x", "br-0004", f"curl -H 'Authorization: {R}' https://x"),
    ("mysql -uroot -phunter3 appdb", "hunter3", f"mysql -uroot -p{R} appdb"),
    ("mysqldump -p'pw 4' appdb", "pw 4", f"mysqldump -p{R} appdb"),
    ("mysql --password=pw-5 appdb", "pw-5", f"mysql --password={R} appdb"),
    ("deploy --password=pw-6 --verbose", "pw-6", f"deploy --password={R} --verbose"),
    ("./configure secret=sec-7", "sec-7", f"./configure secret={R}"),
    ("CLIENT_SECRET=sec-8 ./app", "sec-8", f"CLIENT_SECRET={R} ./app"),
    ("GITHUB_TOKEN=ghp-9 gh pr list", "ghp-9", f"GITHUB_TOKEN={R} gh pr list"),
    ("AWS_SECRET_ACCESS_KEY=ak-10 make", "ak-10", f"AWS_SECRET_ACCESS_KEY={R} make"),
    ("open https://x.example/cb?token=tk-11&next=/", "tk-11", f"open https://x.example/cb?token={R}&next=/"),
    ("login --token tk-12 --verbose", "tk-12", f"login --token {R} --verbose"),
]

# Forms only a command string has (shell words that an argument list would split).
STRING_ONLY: list[tuple[str, str, str]] = [
    ("wget --header Authorization=Bearer tok-13 https://x", "tok-13", f"wget --header Authorization={R} https://x"),
]

# Ordinary commands that must be recorded unchanged.
KEPT = [
    "cp -pr src dst",
    "mkdir -p /tmp/a/b",
    "ssh -p 2222 host",
    "git push -u origin main",
    "sort -u names.txt",
    "git commit -m 'token bucket fix' --author=alice",
    "tokenizer=bert --sort=name",
    "open https://git.example/repo.git",
    "scp file user@host:/tmp",
]

AUDITS = {"shim": operation_details, "platform": audit_details}


@pytest.mark.parametrize("audit", AUDITS)
@pytest.mark.parametrize(
    ("command", "secret", "recorded"), ROWS + STRING_ONLY, ids=[row[0][:40] for row in ROWS + STRING_ONLY]
)
def test_it_redacts_the_secret_in_a_command_string(audit: str, command: str, secret: str, recorded: str) -> None:
    details: dict[str, Any] = AUDITS[audit]("EXECUTE_COMMAND", {"command": command})
    assert details["command"] == recorded
    assert secret not in details["command"]


@pytest.mark.parametrize("audit", AUDITS)
@pytest.mark.parametrize(("command", "secret", "recorded"), ROWS, ids=[row[0][:40] for row in ROWS])
def test_it_redacts_the_secret_in_an_argument_list(audit: str, command: str, secret: str, recorded: str) -> None:
    argv = shlex.split(command)
    details: dict[str, Any] = AUDITS[audit]("EXECUTE_COMMAND", {"argv": argv})
    assert all(secret not in argument for argument in details["argv"]), details["argv"]
    assert details["argv"] == shlex.split(recorded)


@pytest.mark.parametrize("audit", AUDITS)
@pytest.mark.parametrize("command", KEPT)
def test_it_keeps_ordinary_commands_as_they_are(audit: str, command: str) -> None:
    assert AUDITS[audit]("EXECUTE_COMMAND", {"command": command})["command"] == command
    assert AUDITS[audit]("EXECUTE_COMMAND", {"argv": shlex.split(command)})["argv"] == shlex.split(command)


def test_the_shim_package_redaction_imports_no_django() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import machines.shim.redaction, machines.shim.audit; "
        "sys.exit(1 if any(m.split('.')[0] == 'django' for m in sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
