"""The soak benchmark (benchmarks/soak.py), small: 300 random requests (random prompts, max_tokens, stop
strings and ids, seeds, extras, aborts midway) through a pool that preempts often. Every request finishes
exactly once with a reason its parameters explain, and nothing is left behind."""

from benchmarks.soak import soak


def test_300_random_requests_each_finish_once_for_a_reason_and_leave_nothing(tiny_checkpoint):
    report = soak(requests=300, seed=1, model=tiny_checkpoint)
    assert report["problems"] == [] and report["finished_once"] == 300
    assert report["leftovers"] == {"blocks_in_use": 0, "unfinished": 0, "runner_rows": 0, "generators": 0}
    assert report["ok"]
    by_reason = report["by_reason"]
    assert set(by_reason) == {"abort", "length", "stop"} and by_reason["abort"] == report["aborts_sent"]
    assert report["stop_strings"] > 0 and report["preemptions"] > 20
    assert list(report["rss_mib"]) == ["75", "150", "300"]
