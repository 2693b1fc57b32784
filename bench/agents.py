"""Agent read benchmark B9 (goal: bench/README.md#goals).

Usage: ``.venv/bin/python bench/agents.py [--quick] [--database-url URL]`` (``make bench``).

- B9  ``GET /api/v1/agents/{id}/events`` on an agent with 100,000 events: the first page
      (default limit 200) and a page deep in the history (``before`` = the ``next`` cursor
      reached by following 100 pages of 500, i.e. 50,000 events down); and the agents
      page ``/`` (100 per page) of a user with 1,000 agents. Target: p50 <= 50 ms, and a
      query count independent of the data size.

One ``manage.py serve`` (SQLite, in-memory channel layer) on a fresh data dir. The data is
written before it starts, by this script's ``prepare`` mode in a child process with the
server's environment (``bulk_create`` through the ORM into the server's database). The
same child counts the queries of each request in-process (``django.test.Client`` under
``CaptureQueriesContext``) for a small user (10 agents, 100 events) and for the large one
(1,000 agents, 100,000 events): the two counts must be equal. It also records SQLite's
query plan and in-process time of the deep-page query, as the selector builds it and with
an extra ``created_at <= cursor`` bound (information for whoever tunes the selector).

Latencies come from one keep-alive HTTP client, sequential requests, the targets
interleaved round by round with ``GET /healthz`` on the same client (HTTP + Django + one
query: the floor every HTTP read pays). The ratio column divides by that floor.

``--database-url URL`` (a PostgreSQL server URL, e.g. ``postgres://postgres@127.0.0.1/postgres``)
runs everything a second time on a fresh PostgreSQL database created there and dropped
after. Prints a table and writes bench/results/agents.json. Bounded (aborts itself after
HARD_LIMIT seconds) and stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from common import CpuMeter, CpuPerOp, bench_row, finish_report, latency_summary, print_table  # noqa: E402

RESULTS = BENCH / "results" / "agents.json"
HARD_LIMIT = 400  # seconds, both databases included
B9_MAX_P50_MS = 50.0

LARGE_AGENTS = 1000
LARGE_EVENTS = 100_000
SMALL_AGENTS = 10
SMALL_EVENTS = 100
DEEP_PAGES = 100  # pages of DEEP_LIMIT followed through `next` to reach the deep cursor
DEEP_LIMIT = 500

SERVER_ENV: dict[str, Any] = {
    "DISPATCH_HEARTBEAT_INTERVAL": "2",
    "DISPATCH_PROCESS_TTL": "10",
    "DISPATCH_REAP_INTERVAL": "2",
    "DISPATCH_REMOTE_LIVENESS_INTERVAL": "2",
    "DISPATCH_LOG_LEVEL": "WARNING",
}


# --- prepare: runs in a child process with the server's environment ---------------------------


def deep_pages_for(events: int) -> int:
    """Pages of DEEP_LIMIT to follow to the deep cursor: DEEP_PAGES (halfway down 100,000
    events), or halfway down a smaller history (at least one page)."""
    return max(1, min(DEEP_PAGES, events // 2 // DEEP_LIMIT))


def prepare(output: Path, *, agents: int, events: int) -> None:
    """Fill the database of ``DISPATCH_DATA_DIR``/``DATABASE_URL`` and count queries.

    Writes to ``output`` a JSON object: ``large``/``small`` (username, API token, session
    cookie, the agent with the events), ``deep_cursor`` (the large agent's ``next`` cursor
    after DEEP_PAGES pages of DEEP_LIMIT), ``queries`` (per request: the count with the
    small and the large data, and the SQL of the large one), ``oldest_cursor`` (just above
    the oldest page), ``keyset_query`` (plan and in-process median ms of the keyset query
    as built and with a ``created_at`` bound) and ``fill_seconds``.
    """
    # bench/machines.py would shadow the `machines` package of the project.
    sys.path[:] = [entry for entry in sys.path if entry and Path(entry).resolve() != BENCH]
    import django

    django.setup()
    from datetime import timedelta

    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection, transaction
    from django.test import Client
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from agents import selectors
    from agents.models import Agent, AgentEvent, Run
    from core.services import api_token_create

    started = time.monotonic()
    users = get_user_model()

    def fill(username: str, n_agents: int, n_events: int, id_base: int) -> dict[str, Any]:
        user = users.objects.create_user(username, password="bench-password-123")
        now = timezone.now()
        base = now - timedelta(days=30)
        rows = [
            Agent(
                id=f"agt_{id_base + index:012x}",
                owner=user,
                name=f"{username}-{index}",
                type=("expert", "shell", "claude", "codex")[index % 4],
                status=(Agent.Status.RUNNING, Agent.Status.STOPPED, Agent.Status.ERROR)[index % 3],
                cwd="/home/bench/src",
                parent_id=f"agt_{id_base + index - 1:012x}" if index % 5 == 4 else None,
                latest_event_type="working",
                latest_event_message=f"step {index} of the plan: compiling, testing, reading the logs",
                latest_event_at=now - timedelta(minutes=index),
                created_at=base + timedelta(minutes=index),
            )
            for index in range(n_agents)
        ]
        with transaction.atomic():
            Agent.objects.bulk_create(rows, batch_size=500)
            # The agent with the events is the newest, so it is on the first page of `/`.
            target = rows[-1]
            runs = [
                Run(id=f"run_{id_base + index:012x}", agent=target, input={"instruction": f"task {index}"})
                for index in range(max(1, n_events // 1000))
            ]
            Run.objects.bulk_create(runs)
            event_base = now - timedelta(milliseconds=n_events)
            batch: list[AgentEvent] = []
            for index in range(n_events):
                batch.append(
                    AgentEvent(
                        agent=target,
                        run=runs[index % len(runs)] if index % 2 else None,
                        type=("working", "system", "done", "idle")[index % 4],
                        message=f"event {index}: tool call finished in {index % 997} ms with 12 lines of output",
                        metadata={"n": index, "tool": "local_pc_read_file"},
                        created_at=event_base + timedelta(milliseconds=index),
                    )
                )
                if len(batch) == 5000:
                    AgentEvent.objects.bulk_create(batch)
                    batch = []
            AgentEvent.objects.bulk_create(batch)
        token = api_token_create(user=user, name="bench").raw
        browser = Client(SERVER_NAME="127.0.0.1")
        browser.force_login(user)
        return {
            "username": username,
            "token": token,
            "session_cookie": browser.cookies[settings.SESSION_COOKIE_NAME].value,
            "agent": target.pk,
            "agents": n_agents,
            "events": n_events,
        }

    large = fill("bench-large", agents, events, 0x100000)
    small = fill("bench-small", SMALL_AGENTS, SMALL_EVENTS, 0x900000)
    fill_seconds = time.monotonic() - started

    def api(who: dict[str, Any]) -> Client:
        return Client(SERVER_NAME="127.0.0.1", headers={"authorization": f"Bearer {who['token']}"})

    def browser(who: dict[str, Any]) -> Client:
        client = Client(SERVER_NAME="127.0.0.1")
        client.cookies[settings.SESSION_COOKIE_NAME] = who["session_cookie"]
        return client

    def walk(who: dict[str, Any], pages: int, limit: int) -> str:
        client, cursor = api(who), ""
        for _ in range(pages):
            params: dict[str, Any] = {"limit": limit, **({"before": cursor} if cursor else {})}
            response = client.get(f"/api/v1/agents/{who['agent']}/events", params)
            assert response.status_code == 200, response.content[:300]
            cursor = response.json()["next"]
        return cursor

    deep_pages = deep_pages_for(events)
    deep_cursor = walk(large, deep_pages, DEEP_LIMIT)
    small_cursor = walk(small, 1, 20)  # 20 events down the small agent's history

    def measure(request: Callable[[], Any], check: Callable[[Any], None]) -> tuple[int, list[str]]:
        request()  # once per client whatever the data (token stamp, session): not counted
        with CaptureQueriesContext(connection) as captured:
            response = request()
        check(response)
        return len(captured), [query["sql"] for query in captured.captured_queries]

    def ok_events(expected: int) -> Callable[[Any], None]:
        def check(response: Any) -> None:
            assert response.status_code == 200 and len(response.json()["events"]) == expected, response.content[:300]

        return check

    def ok_page(expected: int) -> Callable[[Any], None]:
        def check(response: Any) -> None:
            assert response.status_code == 200 and response.content.decode().count("data-agent=") == expected

        return check

    def ok_agents(expected: int) -> Callable[[Any], None]:
        def check(response: Any) -> None:
            assert response.status_code == 200 and len(response.json()["agents"]) == expected, response.content[:300]

        return check

    def both(
        make: Callable[[dict[str, Any]], Callable[[], Any]], small_check: Callable[[Any], None], large_check: Any
    ) -> dict[str, Any]:
        small_count, _ = measure(make(small), small_check)
        large_count, sql = measure(make(large), large_check)
        return {"small": small_count, "large": large_count, "sql_large": sql}

    events_url = "/api/v1/agents/{}/events"
    queries = {
        "events_first": both(
            lambda who: lambda: api(who).get(events_url.format(who["agent"])),
            ok_events(SMALL_EVENTS),
            ok_events(selectors.EVENTS_DEFAULT_LIMIT),
        ),
        "events_deep": both(
            lambda who: (
                lambda: api(who).get(
                    events_url.format(who["agent"]), {"before": deep_cursor if who is large else small_cursor}
                )
            ),
            ok_events(SMALL_EVENTS - 20),
            ok_events(selectors.EVENTS_DEFAULT_LIMIT),
        ),
        "agents_page": both(
            lambda who: lambda: browser(who).get("/"),
            ok_page(SMALL_AGENTS),
            ok_page(selectors.AGENTS_PAGE_SIZE),
        ),
        "agents_api": both(
            lambda who: lambda: api(who).get("/api/v1/agents"),
            ok_agents(SMALL_AGENTS),
            ok_agents(selectors.AGENTS_PAGE_SIZE),
        ),
    }

    # Why selectors._page adds a plain `created_at <= cursor` bound: the keyset query deep
    # down with it (as built now) and without it (the index can then only seek on agent_id).
    from django.db.models import Q

    agent = Agent.objects.get(pk=large["agent"])
    newest_first = AgentEvent.objects.filter(agent=agent).order_by("-created_at", "-pk")
    oldest_page_above = newest_first[max(0, large["events"] - selectors.EVENTS_DEFAULT_LIMIT - 1)]
    oldest_cursor = selectors.encode_cursor(oldest_page_above.created_at, oldest_page_above.pk)

    def keyset(cursor: str, *, bounded: bool) -> Any:
        created_at, pk = selectors.decode_cursor(cursor, pk_type=int)
        rows = AgentEvent.objects.filter(agent=agent)
        if bounded:
            rows = rows.filter(created_at__lte=created_at)
        rows = rows.filter(Q(created_at__lt=created_at) | Q(created_at=created_at, pk__lt=pk))
        return rows.order_by("-created_at", "-pk")[: selectors.EVENTS_DEFAULT_LIMIT + 1]

    def median_ms(queryset: Any, times: int = 21) -> float:
        samples = []
        for _ in range(times):
            began = time.perf_counter_ns()
            list(queryset.all())
            samples.append((time.perf_counter_ns() - began) / 1e6)
        return round(sorted(samples)[times // 2], 2)

    keyset_query: dict[str, Any] = {}
    for bounded in (False, True):
        name = "as_built_with_created_at_bound" if bounded else "without_the_bound"
        keyset_query[name] = {
            "plan": [str(line) for line in keyset(deep_cursor, bounded=bounded).explain().splitlines()],
            "first_page_ms": median_ms(newest_first[: selectors.EVENTS_DEFAULT_LIMIT + 1]),
            "deep_page_ms": median_ms(keyset(deep_cursor, bounded=bounded)),
            "oldest_page_ms": median_ms(keyset(oldest_cursor, bounded=bounded)),
        }

    output.write_text(
        json.dumps(
            {
                "large": large,
                "small": small,
                "deep_cursor": deep_cursor,
                "deep_offset": deep_pages * DEEP_LIMIT,
                "queries": queries,
                "oldest_cursor": oldest_cursor,
                "keyset_query": keyset_query,
                "vendor": connection.vendor,
                "session_cookie_name": settings.SESSION_COOKIE_NAME,
                "fill_seconds": round(fill_seconds, 1),
            }
        )
    )


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Sizes:
    warmup: int
    requests: int
    rounds: int
    agents: int
    events: int


def run_prepare(env: dict[str, str], sizes: Sizes) -> dict[str, Any]:
    out = Path(env["DISPATCH_DATA_DIR"]) / "bench-prepared.json"
    done = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "prepare",
            "--out",
            str(out),
            "--agents",
            str(sizes.agents),
            "--events",
            str(sizes.events),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    if done.returncode != 0:
        raise RuntimeError(f"prepare failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    prepared: dict[str, Any] = json.loads(out.read_text())
    return prepared


def measure(server_url: str, server_pid: int, prepared: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """Sequential requests on one keep-alive client, targets interleaved round by round."""
    import httpx

    large = prepared["large"]
    events_url = f"/api/v1/agents/{large['agent']}/events"
    auth = {"Authorization": f"Bearer {large['token']}"}
    client = httpx.Client(base_url=server_url, timeout=30)
    client.cookies.set(prepared["session_cookie_name"], large["session_cookie"], domain="127.0.0.1")

    def get(path: str, check: Callable[[httpx.Response], bool], **kwargs: Any) -> Callable[[], None]:
        def once() -> None:
            response = client.get(path, **kwargs)
            if not check(response):
                raise RuntimeError(f"GET {path} answered {response.status_code}: {response.text[:300]}")

        return once

    def events_ok(response: httpx.Response) -> bool:
        return response.status_code == 200 and len(response.json()["events"]) == 200

    targets: dict[str, Callable[[], None]] = {
        "http_floor": get("/healthz", lambda r: r.status_code == 200),
        "events_first": get(events_url, events_ok, headers=auth),
        "events_deep": get(events_url, events_ok, headers=auth, params={"before": prepared["deep_cursor"]}),
        "events_oldest": get(events_url, events_ok, headers=auth, params={"before": prepared["oldest_cursor"]}),
        "agents_page": get("/", lambda r: r.status_code == 200 and r.text.count("data-agent=") == 100),
        "agents_api": get("/api/v1/agents", lambda r: r.status_code == 200 and len(r.json()["agents"]) == 100,
                          headers=auth),
    }  # fmt: skip
    samples: dict[str, list[float]] = {name: [] for name in targets}
    cpu: dict[str, dict[str, float]] = {name: {} for name in targets}
    sizes_bytes: dict[str, int] = {}
    clock = time.perf_counter_ns
    try:
        for once in targets.values():
            for _ in range(sizes.warmup):
                once()
        sizes_bytes = {
            "events_first": len(client.get(events_url, headers=auth).content),
            "agents_page": len(client.get("/").content),
        }
        per_round = max(1, sizes.requests // sizes.rounds)
        names = list(targets)
        for round_index in range(sizes.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                once = targets[name]
                with CpuMeter({"dispatch": server_pid}) as meter:
                    for _ in range(per_round):
                        started = clock()
                        once()
                        samples[name].append((clock() - started) / 1e6)
                for key, value in meter.percent.items():
                    cpu[name][key] = round(cpu[name].get(key, 0.0) + value / sizes.rounds, 1)
    finally:
        client.close()
    return {
        **{name: latency_summary(values) for name, values in samples.items()},
        "cpu": cpu,
        "response_bytes": sizes_bytes,
    }


def run_one(sizes: Sizes, *, postgres_url: str | None) -> dict[str, Any]:
    from remote_calls import logs_on_failure

    from tests.infra import instance

    label = "PostgreSQL" if postgres_url else "SQLite"
    if postgres_url:
        os.environ["DISPATCH_TEST_POSTGRES_URL"] = postgres_url
    with instance(postgres=bool(postgres_url), **SERVER_ENV) as inst, logs_on_failure(inst):
        print(
            f"· {label}: writing {sizes.agents:,} agents and {sizes.events:,} events (+ a small user) "
            "and counting queries in-process…",
            flush=True,
        )
        prepared = run_prepare(inst.env, sizes)
        print(f"  filled in {prepared['fill_seconds']} s; starting manage.py serve…", flush=True)
        server = inst.serve()
        print(
            f"· {label}: {sizes.warmup} warm-up + {sizes.requests} sequential requests per target, "
            f"{sizes.rounds} interleaved rounds…",
            flush=True,
        )
        latencies = measure(server.url, server.proc.pid, prepared, sizes)
    return {"database": label, "agents": sizes.agents, "events": sizes.events, "latency": latencies,
            "prepared": {k: v for k, v in prepared.items() if k not in ("large", "small")}}  # fmt: skip


def _lat(summary: dict[str, float]) -> str:
    return f"{summary['p50_ms']:.2f} / {summary['p95_ms']:.2f}"


_ROWS = [  # (key, what, a B9 target?); formatted with the run's sizes
    ("events_first", "GET /api/v1/agents/{{id}}/events, {events:,} events, first page (200)", True),
    ("events_deep", "same, deep page: `before` = the `next` cursor {deep:,} events down", True),
    ("events_oldest", "info: same, the oldest page (`before` {oldest:,} events down)", False),
    ("agents_page", "agents page / (100 per page), {agents:,} agents", True),
    ("agents_api", "info: GET /api/v1/agents (100 per page), {agents:,} agents", False),
]


def _cpu(lat: dict[str, Any], key: str) -> float | None:
    """The server's CPU ms per request: its mean CPU share while ``key`` was measured x the mean latency."""
    return CpuPerOp.from_percent(lat["cpu"][key].get("dispatch"), lat[key]["mean_ms"]).ms


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The B9 rows (common.bench_row); the baseline is GET /healthz on the same client."""
    table: list[dict[str, Any]] = []
    for run in report["runs"]:
        lat, queries = run["latency"], run["prepared"]["queries"]
        floor = lat["http_floor"]["p50_ms"]
        suffix = "" if run["database"] == "SQLite" else f" [{run['database']}]"
        numbers = {
            "events": run["events"],
            "agents": run["agents"],
            "deep": run["prepared"]["deep_offset"],
            "oldest": run["events"] - 200,
        }
        for key, template, is_target in _ROWS:
            what = template.format(**numbers)
            counts = queries.get(key)
            same = counts is None or counts["small"] == counts["large"]
            p50 = lat[key]["p50_ms"]
            queries_text = f"{counts['small']} / {counts['large']} queries" if counts else "queries as above"
            table.append(
                bench_row(
                    ("B9" if is_target else "(B9')") + suffix,
                    what + " (ms p50/p95)",
                    dispatch=f"{_lat(lat[key])}; {queries_text} (small / large data)",
                    baseline=f"{_lat(lat['http_floor'])} (/healthz floor)",
                    ratio=f"{p50 / floor:.1f}x",
                    cpu=(_cpu(lat, key), _cpu(lat, "http_floor")),
                    goal=f"p50 <= {B9_MAX_P50_MS:g} ms; queries equal" if is_target else "—",
                    passed=(p50 <= B9_MAX_P50_MS and same) if is_target else (None if same else False),
                    numbers={"dispatch_p50_ms": p50, "baseline_p50_ms": floor, "ratio": p50 / floor,
                             "queries": counts},
                )
            )  # fmt: skip
    return table


def print_details(report: dict[str, Any]) -> None:
    print(
        "ms columns: p50 / p95 of sequential requests on one keep-alive HTTP client; 'floor' is GET /healthz on "
        "the same client, interleaved (HTTP + Django + 1 query); queries: in-process count with the small "
        f"data ({SMALL_AGENTS} agents, {SMALL_EVENTS} events) / the large data."
    )
    for run in report["runs"]:
        prepared, lat = run["prepared"], run["latency"]
        print(f"{run['database']}: data written in {prepared['fill_seconds']} s; bytes {lat['response_bytes']}")
        print("    CPU, % of one core, while each target was measured:")
        for name, cpu in lat["cpu"].items():
            print(f"      {name}: " + ", ".join(f"{k} {v:.0f}%" for k, v in cpu.items()))
        for name, keyset in prepared["keyset_query"].items():
            print(
                f"    events keyset query {name}, in-process median ms: first page {keyset['first_page_ms']}, "
                f"50,000 down {keyset['deep_page_ms']}, oldest page {keyset['oldest_page_ms']}; plan:"
            )
            for line in keyset["plan"]:
                print(f"      {line}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["prepare"]:
        parser = argparse.ArgumentParser(description="fill the database and count queries (child process)")
        parser.add_argument("kind", choices=["prepare"])
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--agents", type=int, default=LARGE_AGENTS)
        parser.add_argument("--events", type=int, default=LARGE_EVENTS)
        options = parser.parse_args(argv)
        prepare(options.out, agents=options.agents, events=options.events)
        return 0
    parser = argparse.ArgumentParser(description="Agent read benchmark B9.")
    parser.add_argument("--quick", action="store_true", help="a short run (50 requests per target)")
    parser.add_argument("--requests", type=int, help="sequential requests per target (default 200)")
    parser.add_argument(
        "--database-url", help="also run on a fresh database created on this PostgreSQL server (dropped after)"
    )
    parser.add_argument("--agents", type=int, help=f"agents of the large user (default {LARGE_AGENTS:,}; min 101)")
    parser.add_argument("--events", type=int, help=f"events of its agent (default {LARGE_EVENTS:,}; min 1,000)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS.relative_to(REPO)})"
    )
    options = parser.parse_args(argv)
    sizes = (
        Sizes(warmup=10, requests=50, rounds=2, agents=LARGE_AGENTS, events=LARGE_EVENTS)
        if options.quick
        else Sizes(warmup=20, requests=200, rounds=4, agents=LARGE_AGENTS, events=LARGE_EVENTS)
    )
    if options.requests:
        sizes.requests = options.requests
    if options.agents:
        sizes.agents = max(101, options.agents)
    if options.events:
        sizes.events = max(1000, options.events)

    def abort(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def too_long(signum: int, frame: Any) -> None:
        raise TimeoutError(f"benchmark exceeded {HARD_LIMIT} s; aborted")

    from remote_calls import machine

    signal.signal(signal.SIGTERM, abort)
    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(HARD_LIMIT)
    info = machine()
    started = time.monotonic()
    print(
        f"Agent read benchmark B9 ({'quick' if options.quick else 'full'} run) on {info['cpus']} CPU(s), "
        f"{info['cpu_model']}.",
        flush=True,
    )
    report: dict[str, Any] = {"notes": [], "runs": []}
    try:
        report["runs"].append(run_one(sizes, postgres_url=None))
        if options.database_url:
            report["runs"].append(run_one(sizes, postgres_url=options.database_url))
    except (KeyboardInterrupt, TimeoutError) as exc:
        print(f"aborted ({exc}); every process it started has been stopped", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        signal.alarm(0)
    table = rows(report)
    print()
    print_table(table)
    print()
    print_details(report)
    for run in report["runs"]:
        for key, counts in run["prepared"]["queries"].items():
            if counts["small"] != counts["large"]:
                report["notes"].append(
                    f"{run['database']} {key}: {counts['small']} queries with the small data, "
                    f"{counts['large']} with the large: the count grows with the data"
                )
    return finish_report(
        report=report,
        table=table,
        info=info,
        sizes=sizes,
        server_env=SERVER_ENV,
        output=options.output,
        quick=options.quick,
        strict=options.strict,
        started=started,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
