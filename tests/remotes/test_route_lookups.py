"""The route of a remote call (``remotes.services._route``): callers that miss the short
cache together share one database lookup, a cancelled lookup never fails the callers who
shared it, and a lookup that ``forget_route`` overtook is not cached
(docs/ws-protocol.md#remote-call). Also the waits of ``core.realtime.request_reply`` that
replaced ``asyncio.wait``: they never cancel what they wait on, and build the timeout and
busy errors only when they raise them."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest
from channels.exceptions import ChannelFull

from core import realtime
from core.errors import DispatchError
from core.protocol import ChannelMessage, ChannelRequest
from core.realtime import replies
from remotes import services
from remotes.services import RemoteRoute

KEY = (7, "weather")
ROUTE = RemoteRoute(remote_id=3, channel_name="specific.x!y", server_process_id="proc_1", tools=[])


@pytest.fixture(autouse=True)
def _empty_route_cache() -> Any:
    services._ROUTES.clear()
    services._ROUTE_LOOKUPS.clear()
    yield
    services._ROUTES.clear()
    services._ROUTE_LOOKUPS.clear()


class _Database:
    """Stands in for the one query (``_route_from_database``): counts the lookups and
    answers each when the test releases it."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = asyncio.Event()
        self.answer: RemoteRoute | Exception | None = ROUTE

    async def __call__(self, user_id: int, remotename: str) -> RemoteRoute | None:
        self.calls += 1
        await self.release.wait()
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.fixture
def database(monkeypatch: pytest.MonkeyPatch) -> _Database:
    fake = _Database()
    monkeypatch.setattr(services, "_route_from_database", fake)
    return fake


async def _started(*coroutines: Any) -> list[asyncio.Task[Any]]:
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    for _ in range(5):
        await asyncio.sleep(0)
    return tasks


async def test_callers_missing_together_share_one_lookup_and_its_answer(database: _Database) -> None:
    tasks = await _started(*(services._route(*KEY) for _ in range(20)))
    database.release.set()
    answers = await asyncio.gather(*tasks)
    assert database.calls == 1
    assert answers == [(ROUTE, False)] * 20
    assert await services._route(*KEY) == (ROUTE, True)  # cached now
    assert not services._ROUTE_LOOKUPS


async def test_a_fresh_lookup_is_its_own(database: _Database) -> None:
    tasks = await _started(services._route(*KEY), services._route(*KEY, fresh=True))
    database.release.set()
    await asyncio.gather(*tasks)
    assert database.calls == 2


async def test_a_database_error_reaches_every_sharer_and_nothing_is_cached(database: _Database) -> None:
    database.answer = ConnectionError("database down")
    tasks = await _started(*(services._route(*KEY) for _ in range(3)))
    database.release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert [type(result) for result in results] == [ConnectionError] * 3
    assert database.calls == 1
    assert not services._ROUTES and not services._ROUTE_LOOKUPS


async def test_a_cancelled_owner_leaves_its_sharers_to_look_again(database: _Database) -> None:
    owner, sharer = await _started(services._route(*KEY), services._route(*KEY))
    owner.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert owner.cancelled()
    assert not sharer.done()  # not failed by the owner's cancellation: looking again
    database.release.set()
    assert await sharer == (ROUTE, False)
    assert database.calls == 2


async def test_a_cancelled_sharer_is_cancelled_and_the_lookup_goes_on(database: _Database) -> None:
    owner, sharer = await _started(services._route(*KEY), services._route(*KEY))
    sharer.cancel()
    for _ in range(3):
        await asyncio.sleep(0)
    assert sharer.cancelled()
    database.release.set()
    assert await owner == (ROUTE, False)
    assert database.calls == 1


async def test_a_lookup_overtaken_by_forget_route_is_not_cached(database: _Database) -> None:
    (first,) = await _started(services._route(*KEY))
    services.forget_route(*KEY)  # the remote connected elsewhere meanwhile
    (second,) = await _started(services._route(*KEY))  # looks again, not sharing the old lookup
    database.release.set()
    await asyncio.gather(first, second)
    assert database.calls == 2
    assert services._ROUTES[KEY][1] == ROUTE  # cached by the second lookup only


class Ping(ChannelRequest):
    type: Literal["test.ping"] = "test.ping"


class Pong(ChannelMessage):
    type: Literal["test.pong"] = "test.pong"


async def test_the_wait_never_cancels_what_it_waits_on() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    assert await replies._settled(future, 0.01) is False
    assert not future.cancelled() and not future._callbacks  # left as it was, no callback behind
    asyncio.get_running_loop().call_later(0.01, future.set_result, 1)
    assert await replies._settled(future, 5) is True


async def test_the_errors_are_built_only_when_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    def error(name: str) -> Any:
        def make() -> DispatchError:
            built.append(name)
            return DispatchError("TIMEOUT" if name == "timed_out" else "REMOTE_BUSY", name)

        return make

    with pytest.raises(DispatchError, match=r"^timed_out$"):
        await realtime.request_reply(
            "test.nobody", Ping(), reply=Pong, timeout=0.05, timed_out=error("timed_out"), busy=error("busy")
        )
    assert built == ["timed_out"]

    layer = replies.get_channel_layer()

    async def full(channel: str, message: dict[str, Any]) -> None:
        raise ChannelFull()

    monkeypatch.setattr(layer, "send", full)
    with pytest.raises(DispatchError, match=r"^busy$"):
        await realtime.request_reply(
            "test.nobody", Ping(), reply=Pong, timeout=5, timed_out=error("timed_out"), busy=error("busy")
        )
    assert built == ["timed_out", "busy"]
