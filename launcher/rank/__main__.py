"""`python -m launcher.rank RUN_DIR` (or RUN_DIR/config.yaml): one rank, launcher/rank/entry.py."""

import signal

EARLY_STOPS: list[int] = []
"""Stop signals (Ctrl-C, a scheduler's SIGTERM) that come while this rank still imports
torch (a second or two): Preemption.install takes them over, so a rank stopped at start-up
ends cleanly too, not with a KeyboardInterrupt traceback. Its SIGUSR1 handler also tells
the launcher that the rank now takes signals (launch/start/supervise.py::listening)."""
for _sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(_sig, lambda signum, _frame: EARLY_STOPS.append(signum))

from launcher.exits import exit_now  # noqa: E402
from launcher.rank.entry import main  # noqa: E402 (the handlers above first: this import takes the time)

code = main(early=EARLY_STOPS)
exit_now(code)  # without interpreter teardown, which can abort a rank that finished cleanly
