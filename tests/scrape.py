"""Reading ``/metrics`` as Prometheus would (docs/metrics.md), for the tests of every app.

Counters and histograms are per process and keep counting across tests, so a test
compares a scrape after its action with one before it.
"""

from __future__ import annotations

from typing import Any

from django.test import AsyncClient, Client
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a scrape by (sample name, labels), parsed by prometheus_client."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when the series does not exist (yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def has(samples: Samples, name: str, **labels: str) -> bool:
    """Whether the scrape has that series at all."""
    return (name, frozenset(labels.items())) in samples


async def scrape() -> Samples:
    """``GET /metrics`` from loopback (allowed by default) through the ASGI handler."""
    response = await AsyncClient().get("/metrics")
    assert response.status_code == 200, response.content
    return parse(response.content.decode())


def scrape_sync(**extra: Any) -> Samples:
    """``GET /metrics`` through Django's test client (``extra``: request META such as ``REMOTE_ADDR``)."""
    response = Client().get("/metrics", **extra)
    assert response.status_code == 200, response.content
    return parse(response.content.decode())
