"""The shared world of the test suite (docs/architecture.md#how-the-code-is-written).

Users ``owner`` (alice), ``member`` (bob) and ``outsider`` (carol), their API tokens,
and ``ws_connect`` to open ``/ws`` through the real ASGI application.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import channel_layers
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model

from core.outage import tracker as outage_tracker
from core.services import api_token_create, password_throttle_reset

PASSWORD = "correct horse battery"

# --- markers and the parallel run (README.md "Running the tests") ------------------------
#
# `make test` runs the suite on pytest-xdist workers (``--lane parallel``), then the tests
# marked ``serial`` alone (``--lane serial``). The markers below are given by where a test
# lives, so the folders need no marker of their own; ``SERIAL`` names the files (or
# file::test) that must not run beside others, most because they measure or starve the
# machine and beside other workers would measure those.
SERIAL = {
    "tests/bench/test_agents_bench.py": "a benchmark: it measures throughput on the whole machine",
    "tests/bench/test_live_bench.py": "a benchmark: it measures throughput on the whole machine",
    "tests/bench/test_machines_b4_bench.py": "a benchmark: it measures throughput on the whole machine",
    "tests/bench/test_peers_bench.py": "a benchmark: it measures throughput on the whole machine",
    "tests/integration/test_memory_shim.py": "memory bounds: a serve's VmRSS, with 1 GB pipes and 140 MB of writes",
    "tests/integration/test_memory_ws.py": "memory bounds: a serve's VmRSS under floods of /ws frames",
    "tests/integration/test_body_budget.py": "memory bounds: a serve's VmRSS under 30 posts of 16 MB",
    "tests/integration/test_frozen_dependencies.py": "frozen Redis/PostgreSQL with answers due within 3 s",
}

# Markers by folder: ``bench`` (tests/bench: the benchmarks and their summary), ``real_cli``
# (tests/agents/real_cli: the real Claude Code and Codex CLIs), ``cluster`` (tests that start
# a cluster behind nginx, tests/cluster.py).
FOLDER_MARKERS = {"tests/bench/": "bench", "tests/agents/real_cli/": "real_cli"}
CLUSTER_TESTS = ("tests/integration/test_cluster_", "tests/browser/test_cluster_browser.py")
ROOT = Path(__file__).resolve().parent.parent


# What ``--lane fast`` (`make test-fast`) leaves out: everything that starts real servers,
# browsers, clusters, benchmarks or the real agent CLIs.
SLOW_MARKERS = ("integration", "browser", "multiprocess", "cluster", "bench", "real_cli")
LANES = ("parallel", "serial", "fast")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lane",
        choices=LANES,
        default=None,
        help="parallel: the tests not marked serial; serial: only those; fast: the parallel ones "
        f"not marked {', '.join(SLOW_MARKERS)} (default: every test). Combines with -m.",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_by_place(items)
    lane = config.getoption("lane")
    if lane is None:
        return
    kept, dropped = [], []
    for item in items:
        serial = item.get_closest_marker("serial") is not None
        if lane == "serial":
            keep = serial
        elif lane == "parallel":
            keep = not serial
        else:
            keep = not serial and not any(item.get_closest_marker(name) for name in SLOW_MARKERS)
        (kept if keep else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _mark_by_place(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path)).resolve()
        relative = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
        for folder, marker in FOLDER_MARKERS.items():
            if relative.startswith(folder):
                item.add_marker(marker)
        if relative.startswith(CLUSTER_TESTS):
            item.add_marker("cluster")
        function = f"{relative}::{getattr(item, 'originalname', item.name)}"
        reason = SERIAL.get(relative) or SERIAL.get(function)
        if reason:
            item.add_marker(pytest.mark.serial(reason=reason))


# Values tests/settings.py makes up for its own process (a temporary data dir and dist dir,
# a tmux socket named by its pid). Under xdist the controller imports the settings before it
# starts the workers, which inherit its environment: without this each worker would share the
# controller's data dir, wheel folder and tmux server (and the first worker to finish would
# kill that server under the others).
def _made_by_test_settings(name: str, value: str) -> bool:
    if name == "DISPATCH_TMUX_SOCKET":
        return value == f"dispatch-tests-{os.getpid()}"
    folder = Path(value)
    return folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith("dispatch-tests-")


def _worker() -> str:
    """The xdist worker id (``gw0``…), or "" outside a worker."""
    return os.environ.get("PYTEST_XDIST_WORKER", "")


def pytest_configure(config: pytest.Config) -> None:
    worker = _worker()
    if worker:
        # Workers share the Redis server (CI's second pass) but not its keys: the channel
        # layer's groups, the rate limits and the router's counters are per worker.
        from django.conf import settings

        prefix = f"{settings.REDIS_PREFIX}-{worker}"
        settings.REDIS_PREFIX = prefix
        os.environ["DISPATCH_REDIS_PREFIX"] = prefix
        for layer in settings.CHANNEL_LAYERS.values():
            if "prefix" in layer.get("CONFIG", {}):
                layer["CONFIG"]["prefix"] = prefix
    elif getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") != "no":
        for name in ("DISPATCH_DATA_DIR", "DISPATCH_DIST_DIR", "DISPATCH_TMUX_SOCKET"):
            value = os.environ.get(name, "")
            if value and _made_by_test_settings(name, value):
                del os.environ[name]
                if name != "DISPATCH_TMUX_SOCKET":
                    try:
                        os.rmdir(value)  # still empty: the controller runs no test
                    except OSError:
                        pass


@pytest.fixture(autouse=True, scope="session")
def _private_tmux_server() -> Iterator[None]:
    """Stop the tests' own tmux server (``DISPATCH_TMUX_SOCKET``) when the run ends."""
    yield
    import subprocess

    socket_name = os.environ.get("DISPATCH_TMUX_SOCKET")
    if socket_name:
        subprocess.run(["tmux", "-L", socket_name, "kill-server"], capture_output=True, check=False)


@pytest.fixture(autouse=True)
def _fresh_runtime_state() -> Iterator[None]:
    """Each test starts with an empty channel layer, no recorded password failures and no
    outage on record (``core.outage.tracker`` is process-wide: a test that simulated a dead
    Redis would make every later machine operation answer 503)."""
    channel_layers.backends.clear()
    password_throttle_reset()
    outage_tracker._down.clear()
    yield
    channel_layers.backends.clear()
    outage_tracker._down.clear()


def _user(username: str, **extra: Any) -> Any:
    return get_user_model().objects.create_user(username=username, password=PASSWORD, **extra)


@pytest.fixture
def owner(db: None) -> Any:
    """alice: a staff user who owns things."""
    return _user("alice", is_staff=True)


@pytest.fixture
def member(db: None) -> Any:
    """bob: another user of the same instance."""
    return _user("bob")


@pytest.fixture
def outsider(db: None) -> Any:
    """carol: a user who must never see alice's things."""
    return _user("carol")


@pytest.fixture
def token_for() -> Callable[[Any], str]:
    """Issue an API token for a user; returns the raw token."""

    def issue(user: Any, **kwargs: Any) -> str:
        return api_token_create(user=user, **kwargs).raw

    return issue


@pytest.fixture
def owner_token(owner: Any, token_for: Callable[[Any], str]) -> str:
    return token_for(owner)


@pytest.fixture
def member_token(member: Any, token_for: Callable[[Any], str]) -> str:
    return token_for(member)


@pytest.fixture
def outsider_token(outsider: Any, token_for: Callable[[Any], str]) -> str:
    return token_for(outsider)


class WsClient:
    """A ``/ws`` connection through the real router, speaking JSON frames."""

    def __init__(self, communicator: WebsocketCommunicator) -> None:
        self.communicator = communicator
        self._nonce = 0

    async def send(self, frame: Any) -> None:
        await self.communicator.send_to(text_data=frame if isinstance(frame, str) else json.dumps(frame))

    async def recv(self, timeout: float = 3) -> dict[str, Any]:
        message = await self.communicator.receive_output(timeout)
        if message["type"] == "websocket.close":
            raise AssertionError(f"socket closed with {message.get('code')}")
        result: dict[str, Any] = json.loads(message["text"])
        return result

    async def request(self, action: str, body: Any = None, timeout: float = 3) -> dict[str, Any]:
        """Send an action with a fresh nonce and return its reply (events in between are kept)."""
        self._nonce += 1
        nonce = f"n{self._nonce}"
        frame: dict[str, Any] = {"action": action, "nonce": nonce}
        if body is not None:
            frame["body"] = body
        await self.send(frame)
        return await self.reply(nonce, timeout)

    async def reply(self, nonce: Any, timeout: float = 3) -> dict[str, Any]:
        """The reply carrying ``nonce``; replies to other nonces are kept for their turn."""
        if nonce in self.replies:
            return self.replies.pop(nonce)
        while True:
            frame = await self.recv(timeout)
            if "nonce" not in frame:
                self.events.append(frame)
            elif frame["nonce"] == nonce:
                return frame
            else:
                self.replies[frame["nonce"]] = frame

    @property
    def replies(self) -> dict[Any, dict[str, Any]]:
        if not hasattr(self, "_replies"):
            self._replies: dict[Any, dict[str, Any]] = {}
        return self._replies

    @property
    def events(self) -> list[dict[str, Any]]:
        if not hasattr(self, "_events"):
            self._events: list[dict[str, Any]] = []
        return self._events

    async def next_event(self, timeout: float = 3) -> dict[str, Any]:
        if self.events:
            return self.events.pop(0)
        frame = await self.recv(timeout)
        assert "nonce" not in frame, f"expected an event, got a reply {frame}"
        return frame

    async def closed_with(self, timeout: float = 3) -> int | None:
        """Wait for the server to close; return the close code (skipping other frames)."""
        while True:
            message = await self.communicator.receive_output(timeout)
            if message["type"] == "websocket.close":
                return message.get("code")

    async def nothing_received(self, timeout: float = 0.2) -> bool:
        return await self.communicator.receive_nothing(timeout)


@pytest.fixture
def ws_connect() -> Callable[..., Any]:
    """``async with ws_connect(token=...) as ws``: a connected ``/ws`` client.

    ``token`` authenticates by header; ``headers`` adds raw headers; with neither the
    client must authenticate with its first frame.
    """
    from dispatch.asgi import application

    @asynccontextmanager
    async def connect(
        token: str | None = None, headers: list[tuple[bytes, bytes]] | None = None, path: str = "/ws"
    ) -> AsyncIterator[WsClient]:
        all_headers = list(headers or [])
        if token is not None:
            all_headers.append((b"authorization", f"Bearer {token}".encode()))
        communicator = WebsocketCommunicator(application, path, headers=all_headers)
        connected, _ = await communicator.connect(timeout=5)
        assert connected
        client = WsClient(communicator)
        try:
            yield client
        finally:
            await communicator.disconnect()

    return connect


WEATHER_TOOLS = [
    {
        "name": "get_forecast",
        "description": "Retrieve weather forecast for a location.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    }
]


@pytest.fixture
def weather_tools() -> list[dict[str, Any]]:
    return json.loads(json.dumps(WEATHER_TOOLS))


@pytest.fixture
def count_rows() -> Callable[..., Any]:
    """``await count_rows(Model, **filters)`` from async tests."""

    async def count(model: Any, **filters: Any) -> int:
        return int(await database_sync_to_async(model.objects.filter(**filters).count)())

    return count


@pytest.fixture
def private_tmux(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A private tmux server (``tmux -L dispatch-test-<hex>``) that ``agents.cli``
    uses through ``runner_factory`` for this test, killed afterwards with its socket file.
    Skips when tmux is not installed (``.ci/run`` installs it)."""
    import os
    import shutil
    import subprocess
    import uuid
    from pathlib import Path

    from agents import cli
    from agents.tmux import TmuxRunner

    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    name = f"dispatch-test-{uuid.uuid4().hex[:12]}"
    tmux = TmuxRunner(socket_name=name)
    monkeypatch.setattr(cli, "runner_factory", lambda: tmux)
    yield tmux
    subprocess.run(["tmux", "-L", name, "kill-server"], capture_output=True, check=False)
    (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / name).unlink(missing_ok=True)
