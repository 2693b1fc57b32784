"""Redaction of secret-looking values in audit records (docs/shim-protocol.md#audit).

The one redaction of Dispatch: the shim's local audit log (``machines.shim.audit``) and the
platform's ``AuditRecord`` (``machines.services.audit``) both use it, so what one
hides the other hides too. Standard library only (the shim package installs without
Django).

What is hidden, anywhere in a command string or an argument:

- ``Authorization: …`` / ``Proxy-Authorization: …`` to the end of the line or quote, and
  ``Authorization=<scheme> <value>``;
- ``NAME=value``, ``--name=value`` and ``--name value`` where the name ends in
  password/passwd/secret/token/api-key or is ``*_KEY`` (so ``token=…``, ``secret=…``,
  ``*_TOKEN=…``, ``*_SECRET=…``, ``*_KEY=…``, ``PGPASSWORD=…``);
- the password of a URL's user info: ``https://user:[REDACTED]@host``;
- the password of ``-u user:pass`` / ``--user user:pass`` (curl, wget and friends);
- ``-p<password>`` attached to the flag, in a MySQL/MariaDB client's command line (other
  programs use ``-p`` for ports, parents and flag clusters such as ``cp -pr``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

REDACTED = "[REDACTED]"
"""What replaces a secret-looking value."""

_SECRET_NAME = r"(?:password|passwd|secret|token|api[-_]?key|[A-Za-z0-9]_key)"
_QUOTED_OR_WORD = r"(\"[^\"]*\"|'[^']*'|[^\s&;'\"]+)"
_AUTHORIZATION_HEADER = re.compile(r"(?i)\b((?:proxy-)?authorization\s*:\s*)[^\r\n'\"]+")
_AUTHORIZATION_ASSIGNMENT = re.compile(
    r"(?i)\b((?:proxy-)?authorization\s*=\s*)"
    r"(\"[^\"]*\"|'[^']*'|(?:(?:bearer|basic|token|digest|negotiate)\s+)?[^\s&;'\"]+)"
)
_ASSIGNMENT = re.compile(rf"(?i)((?<![A-Za-z0-9])-{{0,2}}[A-Za-z0-9_.-]*{_SECRET_NAME}\s*=\s*){_QUOTED_OR_WORD}")
_SPACED_FLAG = re.compile(rf"(?i)((?<![A-Za-z0-9])--?[A-Za-z0-9_-]*{_SECRET_NAME}\s+)(\"[^\"]*\"|'[^']*'|[^\s'\"-]\S*)")
_URL_PASSWORD = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^\s/?#@:'\"]*:)[^\s/?#@'\"]+(?=@)")
_USER_FLAG = re.compile(r"((?<![A-Za-z0-9-])(?:-u\s*|--user(?:\s+|=))([\"']?)[^\s:'\"]+:)[^\s'\"]+")
_MYSQL_CLIENT = re.compile(r"(?i)(?<![A-Za-z0-9_-])(?:mysql\w*|mariadb\w*)(?![A-Za-z0-9_-])")
_ATTACHED_P = re.compile(r"((?<![A-Za-z0-9_-])-p)(\"[^\"]*\"|'[^']*'|[^\s'\"]+)")

_FLAG_ELEMENT = re.compile(rf"(?i)^--?[A-Za-z0-9_-]*{_SECRET_NAME}$")
_USER_FLAG_ELEMENT = re.compile(r"^(?:-u|--user)$")


def redact(text: str) -> str:
    """``text`` with every secret-looking value replaced by ``[REDACTED]`` (the module
    docstring lists the forms). ``text``: a command string or one argument; returns it
    otherwise unchanged."""
    text = _AUTHORIZATION_HEADER.sub(rf"\1{REDACTED}", text)
    text = _AUTHORIZATION_ASSIGNMENT.sub(rf"\1{REDACTED}", text)
    text = _ASSIGNMENT.sub(rf"\1{REDACTED}", text)
    text = _SPACED_FLAG.sub(rf"\1{REDACTED}", text)
    text = _URL_PASSWORD.sub(rf"\1{REDACTED}", text)
    text = _USER_FLAG.sub(rf"\1{REDACTED}\2", text)
    if _MYSQL_CLIENT.search(text):
        text = _ATTACHED_P.sub(rf"\1{REDACTED}", text)
    return text


def redact_argv(argv: Sequence[object]) -> list[str]:
    """Each argument of ``argv`` redacted with :func:`redact`, plus what only the argument
    list shows: the argument after a bare secret flag (``--password hunter2``, ``--token
    abc``) is replaced whole, the password of the ``user:pass`` after ``-u``/``--user`` is
    hidden, and ``-p<password>`` is hidden when the program is a MySQL/MariaDB client."""
    texts = [str(argument) for argument in argv]
    mysql = bool(texts) and bool(_MYSQL_CLIENT.fullmatch(texts[0].rsplit("/", 1)[-1]))
    redacted: list[str] = []
    previous = ""
    for text in texts:
        if _FLAG_ELEMENT.match(previous):
            redacted.append(REDACTED)
        elif _USER_FLAG_ELEMENT.match(previous) and ":" in text:
            redacted.append(text.split(":", 1)[0] + ":" + REDACTED)
        elif mysql and text.startswith("-p") and len(text) > 2 and not text.startswith("--"):
            redacted.append("-p" + REDACTED)
        else:
            redacted.append(redact(text))
        previous = text
    return redacted
