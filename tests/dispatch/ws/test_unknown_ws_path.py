"""An unknown websocket path is refused at the upgrade with 403, logged at most at INFO
(``/ws/ws`` used to be an HTTP 500 with an ERROR traceback)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from channels.testing import WebsocketCommunicator
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.infra import Server, instance


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/ws/ws", "/nope", "/ws/shim/extra"])
async def test_the_router_closes_an_unknown_path_before_accept(path: str) -> None:
    from dispatch.asgi import application

    communicator = WebsocketCommunicator(application, path)
    connected, code = await communicator.connect(timeout=5)
    assert connected is False and code == 1000


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with instance() as inst:
        yield inst.serve()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_real_serve_answers_an_unknown_websocket_path_403_without_a_traceback(server: Server) -> None:
    async def upgrade(path: str) -> int:
        try:
            async with connect(f"ws://127.0.0.1:{server.port}{path}", open_timeout=5):
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code

    assert asyncio.run(upgrade("/ws/ws")) == 403
    assert asyncio.run(upgrade("/ws/ws?token=x")) == 403
    assert asyncio.run(upgrade("/ws")) == 101  # the real route still upgrades
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log and " 500 " not in log, log
    assert server.running
