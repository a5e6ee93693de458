"""The hang watchdog's verdict (launcher/rank/watchdog.py::diagnose) from every rank's last
heartbeat: the step and phase name a rank that is behind; when all are inside the same
step, the flight recorder's collective counts do. Real runs: tests/e2e/test_reliability.py."""

from __future__ import annotations

from launcher.rank.watchdog import diagnose

NOW = 1000.0


def beat(step, phase="step", collectives=None, age=1.0):
    return {"step": step, "phase": phase, "at": NOW - age, "collectives": collectives}


def test_a_rank_waiting_for_data_is_named_by_its_phase():
    v = diagnose({0: beat(5, "step", {"0": [52, 49]}), 1: beat(5, "data", {"0": [49, 49]})}, 5, 2, NOW, stale_s=15)
    assert v["silent"] == [1] and v["behind"] == [1] and v["behind_in_collectives"] == [1]
    assert v["text"].startswith(
        "silent: rank(s) 1; rank 0 inside the step after step 5, waiting in collective 52 "
        "of process group 0; rank 1 waiting for data after step 5, has entered 49"
    )


def test_inside_one_step_the_rank_short_of_collectives_is_named():
    v = diagnose({0: beat(5, collectives={"0": [52, 49]}), 1: beat(5, collectives={"0": [49, 49]})}, 5, 2, NOW, 15)
    assert v["silent"] == [1] and v["behind"] == [] and v["behind_in_collectives"] == [1]
    assert (
        "rank 1 inside the step after step 5, has entered 49 collectives of process group 0, the others 52" in v["text"]
    )


def test_without_the_recorder_a_hang_inside_one_step_names_nobody():
    v = diagnose({0: beat(5), 1: beat(5)}, 5, 2, NOW, 15)
    assert v["silent"] == [] and v["text"].startswith("silent: none behind: all 2 ranks are stuck inside step 6")


def test_groups_are_compared_among_their_own_members():
    """tp=2 x dp=2 on 4 ranks: torch ids 1-2 the tp groups {0,1} {2,3}, 3-4 the dp groups
    {0,2} {1,3}; each rank reports its own. Rank 3 stopped before its tp all-reduce: only it
    is named, not rank 1, whose dp group waits for rank 3 too."""
    v = diagnose(
        {
            0: beat(7, collectives={"1": [30, 30], "3": [14, 14]}),
            1: beat(7, collectives={"1": [30, 30], "4": [15, 14]}),
            2: beat(7, collectives={"2": [30, 29], "3": [14, 14]}),
            3: beat(7, collectives={"2": [29, 29], "4": [14, 14]}),
        },
        7,
        4,
        NOW,
        15,
    )
    assert v["silent"] == [3] and v["behind_in_collectives"] == [3], v
    assert "rank 2 inside the step after step 7, waiting in collective 30 of process group 2" in v["text"]
    assert (
        "rank 3 inside the step after step 7, has entered 29 collectives of process group 2, the others 30" in v["text"]
    )


def test_a_frozen_rank_is_named_by_its_heartbeat_and_its_old_counts_are_ignored():
    v = diagnose(
        {0: beat(5, collectives={"0": [52, 49]}), 1: beat(5, collectives={"0": [60, 60]}, age=40.0)}, 5, 2, NOW, 15
    )
    assert v["silent"] == [1] and v["frozen"] == [1] and v["behind_in_collectives"] == []
    assert "rank 1 no heartbeat for 40s (process stopped or gone; last: inside the step after step 5)" in v["text"]
    v = diagnose({0: beat(5), 1: {"step": None}}, 5, 2, NOW, 15)
    assert v["silent"] == [1] and "rank 1 no heartbeat ever" in v["text"]
