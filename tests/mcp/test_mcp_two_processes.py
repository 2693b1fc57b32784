"""The stateless MCP endpoint across two ``serve`` processes (docs/mcp.md#transport): one
client's requests answered alternately by both, with the remote held by one of them
(PostgreSQL for the registry, Redis for the channel layer)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent

from examples.weather_service import get_forecast
from tests.infra import PYTHON, instance, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(120),
]


class Alternating(httpx2.AsyncBaseTransport):
    """Sends each request to the next of ``ports`` in turn (whatever the URL says)."""

    def __init__(self, ports: list[int]) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.ports = itertools.cycle(ports)
        self.answered_by: list[int] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        port = next(self.ports)
        request.url = request.url.copy_with(port=port)
        response = await self.inner.handle_async_request(request)
        self.answered_by.append(port)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture(scope="module")
def ports_and_token() -> Iterator[tuple[list[int], str]]:
    with instance(postgres=True, redis=True) as inst:
        a, b = inst.serve(wait=False), inst.serve(wait=False)
        a, b = a.wait_healthy(), b.wait_healthy()
        connection = ["--url", a.ws_url, "--token", inst.admin_token]
        inst.spawn(
            [PYTHON, "-m", "remotes.client", "serve", "examples/weather_service.py:remote", *connection],
            name="weather-service",
        )
        wait_until(lambda: b.remote_names(inst.admin_token) == ["weather-service"], timeout=20, what="the remote")
        yield [a.port, b.port], inst.admin_token


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_two_serve_processes_answer_one_clients_requests_alternately(
    ports_and_token: tuple[list[int], str], mode: str
) -> None:
    ports, token = ports_and_token
    transport = Alternating(ports)
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx2.AsyncClient(transport=transport, headers=headers, timeout=30) as http:
        url = f"http://127.0.0.1:{ports[0]}/mcp"
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            names = set()
            for _ in range(2):
                names.add(frozenset(tool.name for tool in (await client.list_tools()).tools))
            results = [await client.call_tool("remote__weather-service__get_forecast", {"city": c}) for c in "AB"]
    assert len(names) == 1 and "remote__weather-service__get_forecast" in next(iter(names))
    for city, result in zip("AB", results, strict=True):
        assert not result.is_error, result
        [block] = result.content
        assert isinstance(block, TextContent)
        assert json.loads(block.text) == get_forecast(city)
    assert set(transport.answered_by) == set(ports)
