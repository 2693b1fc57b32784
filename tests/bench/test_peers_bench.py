"""Smoke test of bench/peers.py (B7, B8): three real ``manage.py serve`` processes paired
with ``peer_offer``/``peer_link``, a few mirrored status changes and a few dozen outbox
messages, end to end.

Only correctness is asserted (every change mirrored, every message delivered exactly once
and in order, the down peer's mail tried and still queued), never a latency or a rate.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import assert_rows_in_the_shared_format
from tests.infra import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]  # the bench itself is cut at 400 s


def test_the_peers_bench_mirrors_every_change_and_delivers_each_message_once_in_order(tmp_path: Path) -> None:
    output = tmp_path / "peers.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "peers.py"),
            "--quick",
            "--changes", "10",
            "--messages", "60",
            "--alone-messages", "40",
            "--baseline-messages", "20",
            "--drain-messages", "60",
            "--hole-messages", "30",
            "--backlog-messages", "60",
            "--backlog-window", "3",
            "--output", str(output),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(output.read_text())
    assert [row["id"] for row in report["table"]] == ["B7", "(B8')", "B8", "B8", "B8", "(B8')", "(B8'')"]
    assert_rows_in_the_shared_format(report["table"], {"B7": (True, False)})
    for row in report["table"][1:4]:  # the phases: A's and B's CPU per message, and B's in the bare loop
        assert row["cpu_ms_per_op"]["dispatch"] is not None and row["cpu_ms_per_op"]["baseline"] is not None

    # B7: every one of the 10 changes (after the warm-up) reached the shadow on A and B's own stream.
    b7 = report["b7"]
    assert b7["mirror"]["n"] == b7["local"]["n"] == 10
    assert b7["upserts_seen"]["A"] >= 20  # warm-up included, one upsert per change at least

    # B8: the bare signed POSTs were all accepted by B.
    b8 = report["b8"]
    assert b8["baseline"]["statuses"] == {"200": 20}

    # Through A's REST API, without mail for C, with C stopped, with C unresponsive: exactly once, in order.
    alone, down, unresponsive = b8["phases"]
    assert [phase["name"] for phase in b8["phases"]] == ["alone", "C down", "C unresponsive"]
    for phase, sent in ((alone, 40), (down, 60), (unresponsive, 30)):
        checks = phase["checks"]
        assert checks["complete"], checks
        assert checks["received"] == checks["distinct_keys"] == checks["distinct_contents"] == sent, checks
        assert checks["duplicates"] == 0
        assert checks["keys_match_outbox"] and checks["in_outbox_order"] and checks["posters_ascending"], checks
        assert checks["b_rows_delivered"] == checks["outbox_rows_for_b"] == sent
        assert checks["ok"], checks
    assert alone["checks"]["c_rows"] == 0
    # C's mail was tried (connection refused) and waits in the outbox; it did not stop B's.
    assert down["checks"]["c_rows"] == down["c_mail_sent"] >= 1
    assert down["checks"]["c_rows_queued_and_tried"] >= 1
    assert "could not be reached" in down["checks"]["c_last_error"]
    # With C unresponsive its mail is still queued (never delivered, never dead-lettered).
    assert unresponsive["checks"]["c_rows"] == unresponsive["checks"]["c_rows_queued"] == unresponsive["c_mail_sent"]

    # Drained by outbox_drain_peer alone: all 60, once, in order; every row step was timed.
    drain = b8["drain"]
    assert drain["delivered"] == 60 and drain["checks"]["ok"], drain["checks"]
    # B announced messages.batch at pairing: 60 rows went in a few signed POSTs (50 a batch at most).
    assert 2 <= drain["steps"]["PeerClient.post (signed POST: one row, or a batch)"]["calls"] < 60
    assert drain["steps"]["outbox_mark_delivered_many"]["calls"] >= 2

    # The backlog: nothing is delivered twice, nothing beyond what was queued.
    backlog = b8["backlog"]
    assert backlog["queued"] == 61
    assert backlog["duplicates"] == 0 and backlog["delivered"] <= 61
    assert sum(burst["messages"] for burst in backlog["bursts"]) == backlog["delivered"]
