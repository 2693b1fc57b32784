"""Every client reaches Dispatch only through nginx (docs/deploy.md#nginx): the official
TypeScript MCP SDK client (``tests/clients/mcp_client.mjs``, the client Claude Code, Cursor
and the MCP Inspector are built on) against the three-process topology over https.

No sticky sessions: the SDK's POSTs (initialize, tools/list, tools/call) and its ``GET
/mcp`` stream each land where least-connections puts them, and the remote it then calls
registers through nginx wherever it lands. The stream must still announce
``notifications/tools/list_changed`` when that remote connects, and the call must reach
it, whichever processes hold the stream, the POSTs and the remote (printed).
"""

from __future__ import annotations

import json
import time

import pytest

from examples.weather_service import get_forecast
from tests.cluster import Cluster, shared_cluster, trusting
from tests.infra import PYTHON, wait_until
from tests.mcp.test_mcp_typescript_client import REMOTE_TOOL, NodeClient, node_or_skip

pytestmark = [
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(180),
]


@pytest.fixture
def topo(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    topo = shared_cluster(request.config, tls=True)
    trusting(topo, monkeypatch)  # NODE_EXTRA_CA_CERTS for node, SSL_CERT_FILE for the remote client
    return topo


def _process_of(topo: Cluster, sql: str) -> list[int | str]:
    index = topo.process_index()
    return [index.get(str(row[0]), str(row[0])) for row in topo.rows(sql)]


def test_the_typescript_sdk_client_through_nginx_hears_and_calls_a_remote_on_any_process(topo: Cluster) -> None:
    node = node_or_skip()
    assert topo.url.startswith("https://")
    client = NodeClient(node, f"{topo.url}/mcp", topo.token, REMOTE_TOOL, json.dumps({"city": "Oslo"}))
    remote = None
    try:
        initialized = client.until("initialized", timeout=30)
        assert initialized["protocolVersion"] == "2025-11-25"
        assert initialized["capabilities"]["tools"] == {"listChanged": True}
        client.until("stream_open", timeout=30)  # the GET stream's list_changed on connect
        assert REMOTE_TOOL not in client.until("tools")["names"]
        assert client.until("launch_without_type")["isError"] is True  # a refusal, answered as a tool error
        assert client.until("machine_tool")["isError"] is False

        client.until("waiting_for_remote")
        wait_until(lambda: topo.rows("SELECT 1 FROM dispatch_mcpstream"), timeout=10, what="the GET stream's row")
        stream_on = _process_of(topo, "SELECT server_process_id FROM dispatch_mcpstream")
        remote = topo.instance.spawn(
            [
                PYTHON,
                "-m",
                "remotes.client",
                "serve",
                "examples/weather_service.py:remote",
                "--url",
                topo.ws_url,
                "--token",
                topo.token,
            ],
            name="weather-through-nginx",
        )
        spawned_at = time.monotonic()
        client.until("list_changed", timeout=30)
        heard = time.monotonic() - spawned_at
        assert REMOTE_TOOL in client.until("tools_after")["names"]
        called = client.until("remote_tool")
        assert called["isError"] is False, called
        assert json.loads(called["text"]) == get_forecast("Oslo")
        client.until("done")
        assert client.proc.wait(10) == 0, client.stderr()
        assert not [line for line in client.seen if line["step"] == "transport_error"], client.seen
        where = {
            "get_stream_on": stream_on,
            "remote_on": _process_of(
                topo, "SELECT server_process_id FROM remotes_remote WHERE name = 'weather-service'"
            ),
            "list_changed_s_after_remote_start": round(heard, 2),
        }
        print(f"TypeScript SDK through nginx: {json.dumps(where)}")
    except BaseException:
        print(topo.details())
        raise
    finally:
        client.stop()
        if remote is not None:
            remote.stop()
