"""Reading zpipe's JSON-lines logs back (zpipe.log.read_events), as tests and benches
do: the named events' records in order, other lines skipped."""

from __future__ import annotations

import json

from zpipe.log import read_events


def test_the_named_events_come_back_in_order_and_other_lines_are_skipped() -> None:
    text = "\n".join(
        [
            json.dumps({"event": "stage_dead", "stage": "b"}),
            "Traceback (most recent call last): {not json",
            json.dumps({"event": "stage_suspect", "stage": "a"}),
            '{"event": "stage_dead", "stage": ',  # cut short: not a record
            json.dumps(["stage_dead"]),  # JSON, not a record
            json.dumps({"event": "stage_dead", "stage": "c"}),
        ]
    )
    assert [r["stage"] for r in read_events(text, "stage_dead")] == ["b", "c"]
    both = read_events(text, "stage_dead", "stage_suspect")
    assert [r["stage"] for r in both] == ["b", "a", "c"]
    assert len(read_events(text)) == 3  # every record when none is named
    assert read_events(text, "run_failed") == []
