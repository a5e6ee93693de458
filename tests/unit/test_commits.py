"""Commit subjects of at most 72 characters, the details in the body (issue 50, item 6): held
for every commit since the rule came in, so `git log --oneline` reads as a list of changes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SINCE = "e8e57c2"  # the first commit under the rule ("tests: imports sorted after the lint merge")
SUBJECT = 72


def subjects(since: str) -> list[str]:
    try:
        out = subprocess.run(
            ["git", "log", "--format=%s", f"{since}..HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"no git here: {err}")
    if out.returncode != 0:
        pytest.skip(f"no history back to {since} (a shallow clone or an export): {out.stderr.strip()[:200]}")
    return out.stdout.splitlines()


def test_commit_subjects_fit_72_characters():
    long = [s for s in subjects(SINCE) if len(s) > SUBJECT]
    assert long == [], f"{len(long)} commit subject(s) over {SUBJECT} characters (details go in the body): {long}"


def test_the_check_catches_the_last_long_subject_before_the_rule():
    before = "d37d777"  # 75 characters: "Comments name the moved modules (parallel/cuts.py, ...)"
    assert [len(s) for s in subjects(f"{before}~1") if len(s) > SUBJECT] == [75]
