"""Exit codes and the marker files that explain them.

A rank that stops for a known reason leaves a small JSON file in RUN_DIR; torchrun itself
exits 1 whatever happened, so the launcher (launch/start/supervise.py) reads the marker and
exits with the code that says why, after printing the reason.
"""

import os
import sys

EXIT_BAD_INPUT = 2  # refused on the launch side, nothing started
EXIT_CHECKPOINT_FAILED = 74  # sysexits EX_IOERR: a checkpoint could not be written; the last good one stays
EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: stopped on a signal after saving; launch again to resume
EXIT_HANG = 124  # a rank stopped answering for dist.timeout_s (as timeout(1) exits)
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), the shell's 128 + 2: saved after the current step (or, twice, at once)

PREEMPTED_MARKER = "preempted.json"
HANG_MARKER = "hang.json"
HANG_STACKS = "hang"  # folder: each rank's Python stacks (every thread) when its watchdog fires: rank<N>.txt
COMM_TRACE = "comm_trace"  # folder: each rank's collective flight record on a hang (rank_<N>, torch's format)
CHECKPOINT_FAILED_MARKER = "checkpoint_failed.json"
OOM_MARKER = "oom.json"  # a rank ran out of memory: with train.oom_backoff the launcher backs off and relaunches

# marker file -> exit code, in the order the launcher checks them
MARKERS = {
    CHECKPOINT_FAILED_MARKER: EXIT_CHECKPOINT_FAILED,
    HANG_MARKER: EXIT_HANG,
    PREEMPTED_MARKER: EXIT_PREEMPTED,
}


def exit_now(code: int) -> None:
    """End a process of a gloo group (a rank, a probe, a hand-written loop) without the
    interpreter's teardown: C++ threads torn down during finalization can abort a process
    that finished cleanly ("terminate called without an active exception"), and torchrun
    would report a failure. stdout and stderr are flushed first; nothing else is pending."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
