"""`python -m launcher.rank RUN_DIR` (or RUN_DIR/config.yaml): one rank, launcher/rank/entry.py."""

import os
import signal
import sys

EARLY_STOPS: list[int] = []
"""Stop signals (Ctrl-C, a scheduler's SIGTERM) that come while this rank still imports
torch (a second or two): Preemption.install takes them over, so a rank stopped at start-up
ends cleanly too, not with a KeyboardInterrupt traceback. Its SIGUSR1 handler also tells
the launcher that the rank now takes signals (launch/supervise.py::listening)."""
for _sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(_sig, lambda signum, _frame: EARLY_STOPS.append(signum))

from launcher.rank.entry import main  # noqa: E402 (the handlers above first: this import takes the time)

code = main(early=EARLY_STOPS)
# Skip interpreter teardown: with gloo, C++ threads torn down during finalization can abort
# a rank that already finished cleanly ("terminate called without an active exception"),
# and the job would be marked failed. Everything is flushed and closed.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
