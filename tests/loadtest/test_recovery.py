"""The recovery benchmark's bookkeeping (the kill itself runs in tests/serving/test_server_resilience.py)."""

from __future__ import annotations

from loadtest.recovery import Probe, RecoveryRun, _error_message, table


def test_a_run_counts_answers_and_the_longest_wait():
    run = RecoveryRun(served_s=9.5, noticed_s=1.5, probes=[Probe(0.1, 10.1, 503, "no replica"), Probe(0.6, 9.5, 200),
                                                          Probe(1.1, 1.2, None, "ClientConnectionError")])
    record = run.to_dict()
    assert record["statuses"] == {"503": 1, "200": 1, "no answer": 1}
    assert record["longest_wait_s"] == 10.0


def test_table_has_a_row_per_run_and_medians_over_the_phases_seen():
    runs = [RecoveryRun(served_s=s, noticed_s=1.0, running_s=r).to_dict() for s, r in ((10.0, 9.0), (12.0, None))]
    text = table(runs)
    lines = text.splitlines()
    assert len(lines) == 2 + 2 + 1
    assert lines[-1].startswith("| median | 1.0 |") and "| 9.0 | 11.0 |" in lines[-1]


def test_error_message_reads_openai_bodies_and_keeps_anything_else():
    assert _error_message(b'{"error": {"message": "no replica", "type": "service_unavailable"}}') == "no replica"
    assert _error_message(b"Path not found").endswith("Path not found")
