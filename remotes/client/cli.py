"""Command line for Dispatch remotes (docs/ws-protocol.md#the-python-client):
``dispatch-remote``, or ``python -m remotes.client`` in a clone of the server. Its help
(:data:`DESCRIPTION`) says how it is used; this module's functions are documented one by one
below.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from .remote import TOKEN_ENV, URL_ENV, Remote, RemoteDisconnected, announce_on_stderr
from .session import DEFAULT_URL, AuthenticationError, RemoteCallError, Session, websocket_url

DESCRIPTION = f"""\
Serve Python functions as a Dispatch remote, and call remotes.

  dispatch-remote serve FILE.py:VARIABLE [--server URL] [--token T] [-v]
  dispatch-remote call REMOTENAME FUNCTION ARGS_JSON [--server URL] [--token T]
                       [--timeout SECONDS]
  dispatch-remote list [--server URL] [--token T]
  dispatch-remote --version

--server (or --url) names the instance by its base URL, http(s)://host:port, whose
ws(s)://host:port/ws is used; a ws(s)://host:port/ws URL works too. Default: ${URL_ENV}
(same forms), else {DEFAULT_URL}; --token defaults to ${TOKEN_ENV}. serve gives
--server/--url and --token to the Remote in the file, replacing its own url and token;
without them it uses the Remote's own, else ${URL_ENV} and ${TOKEN_ENV}.

serve prints one line on stderr each time the remote is registered ("serving
'weather-service' (1 function) on ws://.../ws", then "reconnected: ..."), one for each
retry while the server still holds the name, and logs warnings only, unless -v.

Exit codes: 0 success, 1 a failed call or connection, 2 bad usage or no token,
130 interrupted. The protocol: docs/ws-protocol.md in the Dispatch repository.
"""
SERVER_CALL_TIMEOUT_MAX = 300.0
"""Seconds: the longest per-call ``timeout`` the server accepts (docs/ws-protocol.md#remote-call)."""
REPLY_MARGIN = 10.0
"""Seconds ``call`` waits for the reply beyond the server-side call timeout."""

_CLIENT_ERRORS = (
    RemoteCallError,
    AuthenticationError,
    ConnectionClosed,
    InvalidHandshake,
    InvalidURI,
    OSError,  # includes TimeoutError
)


class _UsageError(Exception):
    """Bad command-line input; reported with exit code 2."""


def _join_option_values(argv: list[str]) -> list[str]:
    """``--token -abc`` → ``--token=-abc``: a token may start with ``-``, which argparse
    would otherwise read as an option."""
    joined: list[str] = []
    index = 0
    while index < len(argv):
        if argv[index] in ("--token", "--url", "--server") and index + 1 < len(argv):
            joined.append(f"{argv[index]}={argv[index + 1]}")
            index += 2
        else:
            joined.append(argv[index])
            index += 1
    return joined


def main(argv: Sequence[str] | None = None, prog: str = "dispatch-remote") -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); return the exit code.

    ``call`` prints the result as JSON on stdout; ``list`` prints the ``remote-list``
    entries (``[{remotename, name, description, parameters}]``) as JSON; failures are
    printed on stderr. argparse itself exits with 2 on malformed arguments. ``prog`` is
    how the user started it (``python -m remotes.client`` in a clone).
    """
    args = _parser(prog).parse_args(_join_option_values(list(sys.argv[1:] if argv is None else argv)))
    try:
        if args.command == "serve":
            return _serve(args.target, _session_url(args, environment=False), args.token, verbose=args.verbose)
        url = _session_url(args)
        token: str | None = args.token or os.environ.get(TOKEN_ENV)
        if not token:
            raise _UsageError(f"no API token: pass --token or set {TOKEN_ENV}")
        if args.command == "list":
            return _request(url, token, "remote-list", {}, 30.0, "remotes")
        body = {"remotename": args.remotename, "function": args.function, "args": args.args}
        if args.timeout is not None:
            body["timeout"] = args.timeout
        wait = (args.timeout or SERVER_CALL_TIMEOUT_MAX) + REPLY_MARGIN
        return _request(url, token, "remote-call", body, wait, "result")
    except _UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _session_url(args: argparse.Namespace, *, environment: bool = True) -> str | None:
    """The ``/ws`` URL of ``--url``, else of ``--server``, else (with ``environment``) of
    ``$DISPATCH_URL`` (each an http(s) base URL or a ws(s) URL,
    :func:`.session.websocket_url`), else ``None``."""
    given = args.url or args.server or (os.environ.get(URL_ENV) if environment else None)
    if not given:
        return None
    try:
        return websocket_url(given)
    except ValueError as error:
        source = "--url" if args.url else "--server" if args.server else f"${URL_ENV}"
        raise _UsageError(f"{source}: {error}") from None


def _parser(prog: str = "dispatch-remote") -> argparse.ArgumentParser:
    connection = argparse.ArgumentParser(add_help=False)
    where = connection.add_mutually_exclusive_group()
    where.add_argument(
        "--server",
        metavar="URL",
        help=f"the instance's base URL, http(s)://host:port; its /ws is used (default: ${URL_ENV}, else {DEFAULT_URL})",
    )
    where.add_argument("--url", metavar="URL", help="the same as --server; also takes ws(s)://host:port/ws")
    connection.add_argument("--token", help=f"API token (default: ${TOKEN_ENV})")
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--version", action=_PrintVersion)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", parents=[connection], help="serve a Remote from a file")
    serve.add_argument(
        "target",
        metavar="FILE.py:VARIABLE",
        help="a Python file and the name of the variable in it that holds the Remote, e.g. weather.py:remote",
    )
    serve.add_argument("-v", "--verbose", action="store_true", help="log connections and calls")
    call = commands.add_parser("call", parents=[connection], help="call a remote function")
    call.add_argument("remotename")
    call.add_argument("function")
    call.add_argument("args", metavar="ARGS_JSON", type=_json_object, help="a JSON object")
    call.add_argument("--timeout", type=float, metavar="SECONDS", help="server-side, at most 300")
    commands.add_parser("list", parents=[connection], help="list your connected remotes' functions")
    return parser


class _PrintVersion(argparse.Action):
    """``--version``: print :func:`_version` and exit (looked up only when asked: it reads
    every installed distribution's metadata)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help="show the version, exit")

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(_version())
        parser.exit()


def _version() -> str:
    """``dispatch-remote 0.1.0`` when installed; in a clone, that it is not installed."""
    top_level = (__package__ or "").split(".")[0]
    for distribution in importlib.metadata.packages_distributions().get(top_level, []):
        return f"{distribution} {importlib.metadata.version(distribution)}"
    return f"{__package__} (not installed: running from a source checkout)"


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _request(
    url: str | None,
    token: str,
    action: str,
    body: dict[str, Any],
    timeout: float,
    field: str,
) -> int:
    """Send one request (``timeout`` in seconds) to ``url`` (``None``: :data:`DEFAULT_URL`)
    and print the reply's ``field`` as JSON.

    Returns 0, or 1 after printing the error (an error reply, a refused token, a failed
    connection, no reply in time) on stderr; a failed connection names the URL tried, and
    how to name another when it was the default. An absent field prints ``null``.
    """
    session_url = url or DEFAULT_URL
    connected = False

    async def exchange() -> dict[str, Any]:
        nonlocal connected
        session = await Session.connect(session_url, token)
        connected = True
        try:
            return await session.request(action, body, timeout=timeout)
        finally:
            await session.close()

    try:
        reply = asyncio.run(exchange())
    except _CLIENT_ERRORS as error:
        message = str(error) or type(error).__name__
        if not connected:
            hint = "" if url else f" (the default: pass --server http(s)://host:port or set {URL_ENV})"
            message = f"cannot connect to {session_url}{hint}: {message}"
        print(f"error: {message}", file=sys.stderr)
        return 1
    print(json.dumps(reply.get(field), indent=2))
    return 0


def _serve(target: str, url: str | None, token: str | None, *, verbose: bool) -> int:
    """Serve the Remote ``target`` names until it is refused (exit 1) or interrupted.

    ``url`` (from ``--url``/``--server``) and ``token`` (``--token``) replace the Remote's
    own when given; without them it keeps its own, else :meth:`.Remote.serve` falls back
    to ``$DISPATCH_URL`` and ``$DISPATCH_TOKEN``.
    """
    remote = _load_remote(target)
    remote.url = url or remote.url
    remote.token = token or remote.token
    if not (remote.token or os.environ.get(TOKEN_ENV)):
        raise _UsageError(f"no API token: pass --token, set {TOKEN_ENV}, or give the Remote a token")
    try:
        remote.session_url()
    except ValueError as error:
        raise _UsageError(f"{target}: {error}") from None
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        asyncio.run(remote.serve(announce=announce_on_stderr))
    except (AuthenticationError, RemoteCallError, RemoteDisconnected, InvalidURI) as error:
        print(f"error: {error}", file=sys.stderr)
    return 1


def _load_remote(target: str) -> Remote:
    """Import ``FILE.py`` by path (its folder first on ``sys.path``) and return the Remote
    held by its module-level variable ``VARIABLE``. Code under ``if __name__ ==
    "__main__":`` does not run (the module is not ``__main__``)."""
    file_name, _, attribute = target.rpartition(":")
    if not file_name or not attribute:
        raise _UsageError(f"expected FILE.py:VARIABLE, got {target!r}")
    path = Path(file_name).resolve()
    if not path.is_file():
        raise _UsageError(f"no such file: {file_name}")
    spec = importlib.util.spec_from_file_location(f"dispatch_remote_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise _UsageError(f"cannot import {file_name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic and dataclasses look their module up here
    sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(module)
    remote = getattr(module, attribute, None)
    if not isinstance(remote, Remote):
        raise _UsageError(f"{target}: {attribute!r} is not a Remote but {type(remote).__name__}")
    return remote
