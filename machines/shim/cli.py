"""Command line of the shim (spec/machines.md §8)::

    python -m machines.shim login --server URL [--state-dir DIR]
    python -m machines.shim run [--server URL] [--token T] [--state-dir DIR] [--config FILE]
                                [--root DIR]... [--session ID]... | [--all-sessions]
                                [--name DISPLAY_NAME] [--no-shell] [--no-files]
    python -m machines.shim status [--state-dir DIR]
    python -m machines.shim logout [--state-dir DIR]

The state directory is ``--state-dir``, else ``$DISPATCH_SHIM_STATE_DIR``, else
``~/.config/dispatch-shim``; it holds ``state.json`` (machine_id, server, token; mode
0600), ``config.toml`` (allowed_roots, capabilities, [limits]) and ``audit.jsonl``.
``run`` takes its token from ``--token``, else ``$DISPATCH_SHIM_TOKEN``, else the stored
login; its roots from ``--root``, else the config file, else the home directory.
Exit codes: 0 success (``run``: stopped by SIGINT/SIGTERM), 1 refused or failed, 2 bad
usage or configuration, 130 interrupted login.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from .audit import AuditLog
from .connection import Shim, ShimRefused, websocket_url
from .jail import PathJail
from .login import LoginError, device_login
from .operations import MachineIdentity
from .protocol import SESSION_ID_PATTERN, Capability
from .state import ConfigError, StateError, StateStore, load_config

TOKEN_ENV = "DISPATCH_SHIM_TOKEN"
"""Environment variable holding a token for headless ``run`` (§8)."""

SESSION_ID = re.compile(SESSION_ID_PATTERN)
"""A machine session id (§4)."""


class _UsageError(Exception):
    """Bad command-line input or configuration; reported with exit code 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    args = _parser().parse_args(argv)
    try:
        store = StateStore(args.state_dir)
        if args.command == "login":
            return _login(args, store)
        if args.command == "run":
            return _run(args, store)
        if args.command == "status":
            return _status(store)
        return _logout(store)
    except (_UsageError, ConfigError, StateError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-dir",
        metavar="DIR",
        help="state directory (default: $DISPATCH_SHIM_STATE_DIR, else ~/.config/dispatch-shim)",
    )
    parser = argparse.ArgumentParser(prog="python -m machines.shim", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    commands = parser.add_subparsers(dest="command", required=True)

    login = commands.add_parser("login", parents=[common], help="log in with the device flow")
    login.add_argument("--server", required=True, help="the instance's base URL, http(s)://host:port")

    run = commands.add_parser("run", parents=[common], help="connect and serve operations")
    run.add_argument("--server", help="base URL (default: the one logged in to)")
    run.add_argument("--token", help=f"machine or API token (default: ${TOKEN_ENV}, else the stored login)")
    run.add_argument("--config", metavar="FILE", help="configuration file (default: <state-dir>/config.toml)")
    run.add_argument(
        "--root", action="append", default=[], metavar="DIR", help="an allowed root (repeatable; default: home)"
    )
    sessions = run.add_mutually_exclusive_group()
    sessions.add_argument(
        "--session", action="append", default=[], metavar="ID", help="attach to this session only (repeatable)"
    )
    sessions.add_argument("--all-sessions", action="store_true", help="attach to every session (the default)")
    run.add_argument("--name", metavar="DISPLAY_NAME", help="display name shown to users and agents")
    run.add_argument("--no-shell", action="store_true", help="do not offer the shell capability")
    run.add_argument("--no-files", action="store_true", help="do not offer the files capability")
    run.add_argument("-v", "--verbose", action="store_true", help="log every frame's handling")

    commands.add_parser("status", parents=[common], help="show the stored login (never the token)")
    commands.add_parser("logout", parents=[common], help="forget the stored token")
    return parser


def _login(args: argparse.Namespace, store: StateStore) -> int:
    try:
        state = device_login(args.server, store)
    except LoginError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Logged in to {state.server} as machine {state.machine_id}; token stored in {store.path}")
    return 0


def _run(args: argparse.Namespace, store: StateStore) -> int:
    config = load_config(args.config or store.config_path)
    state = store.ensure_machine_id()
    assert state.machine_id is not None
    token = args.token or os.environ.get(TOKEN_ENV) or state.token
    if not token:
        raise _UsageError(
            f"no token: run `python -m machines.shim login --server URL`, pass --token or set {TOKEN_ENV}"
        )
    server = args.server or state.server
    if not server:
        raise _UsageError("no server: pass --server http(s)://host:port (or log in first)")
    try:
        websocket_url(server)
        jail = PathJail(args.root or config.allowed_roots or [str(Path.home())])
    except ValueError as error:
        raise _UsageError(str(error)) from None
    if args.name is not None and not 0 < len(args.name.strip()) <= 255:
        raise _UsageError("--name must be 1 to 255 characters")
    for session_id in args.session:
        if not SESSION_ID.match(session_id):
            raise _UsageError(f"not a session id: {session_id!r}")
    capabilities = set(config.capabilities or [str(c) for c in Capability])
    if args.no_shell:
        capabilities.discard(Capability.SHELL)
    if args.no_files:
        capabilities.discard(Capability.FILES)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    shim = Shim(
        server=server,
        token=token,
        identity=MachineIdentity.detect(state.machine_id, args.name.strip() if args.name else None),
        jail=jail,
        capabilities=capabilities,
        sessions=args.session or ["*"],
        limits=config.limits,
        audit=AuditLog(store.audit_path),
    )
    print(
        f"shim {state.machine_id} serving {', '.join(jail.roots)} "
        f"({', '.join(shim.capabilities) or 'no capabilities'}) on {shim.url}",
        file=sys.stderr,
    )
    try:
        asyncio.run(_serve(shim))
    except ShimRefused as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


async def _serve(shim: Shim) -> None:
    """Run ``shim`` until it is refused or SIGINT/SIGTERM stops it cleanly."""
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signal_number, shim.stop)
    await shim.run()


def _status(store: StateStore) -> int:
    state = store.load()
    config_note = "" if store.config_path.exists() else " (not present)"
    print(f"state file: {store.path}")
    print(f"server:     {state.server or '(not logged in)'}")
    print(f"machine_id: {state.machine_id or '(not created yet)'}")
    print(f"token:      {'stored' if state.token else 'not stored'}")
    print(f"config:     {store.config_path}{config_note}")
    print(f"audit log:  {store.audit_path}")
    return 0


def _logout(store: StateStore) -> int:
    state = store.load()
    if not state.token:
        print("No token was stored.")
        return 0
    state.token = None
    store.save(state)
    print(f"Token removed from {store.path} (the machine_id is kept).")
    return 0
