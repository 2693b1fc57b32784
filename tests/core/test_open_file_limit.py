"""``serve`` raises its soft open-file limit (core/open_files.py ``raise_open_file_limit``):
started from a shell whose soft limit is 512, a process could otherwise hold only ~500
websockets while the hard limit allows far more."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.open_files import OPEN_FILES_WANTED, raise_open_file_limit
from tests.infra import instance


@pytest.fixture
def low_soft_limit() -> Iterator[int]:
    """The test process's soft limit lowered to 512 (children inherit it), then restored;
    yields the soft limit a raise should reach: ``OPEN_FILES_WANTED`` within the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        yield OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(OPEN_FILES_WANTED, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def soft_open_files(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no 'Max open files' in /proc/{pid}/limits")


def test_raise_open_file_limit_goes_up_to_the_hard_limit_and_never_down(low_soft_limit: int) -> None:
    wanted = low_soft_limit
    assert raise_open_file_limit() == (512, wanted)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == wanted
    assert raise_open_file_limit(wanted=600) == (wanted, wanted)  # already higher: left alone


@pytest.mark.integration  # a real `serve` subprocess
def test_a_served_process_started_with_512_descriptors_has_more(low_soft_limit: int) -> None:
    with instance() as inst:
        server = inst.serve()
        assert soft_open_files(server.proc.pid) == low_soft_limit
