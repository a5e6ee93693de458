"""`python -m launcher ...` and the `launcher` console script."""

import signal
import sys

from launcher.exits import EXIT_INTERRUPTED


def entry() -> int:
    # A Ctrl-C while the launch side and Hydra import is recorded, not raised: a
    # KeyboardInterrupt inside an import can be swallowed by a library's bare `except:`, and
    # the run would then start as if nothing had been pressed. The launch side's modules
    # import no torch when imported (`launcher --help` does without it); the commands hold
    # a Ctrl-C the same way while they import it (launch/start/supervise.py::interrupts_held).
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
    from launcher.launch.cli import main  # local: order (SIGINT caught first: a Ctrl-C while importing is recorded)

    if pressed:
        print("interrupted (Ctrl-C) before training started", file=sys.stderr)
        return EXIT_INTERRUPTED
    signal.signal(signal.SIGINT, signal.default_int_handler)  # main() turns it into one line
    return main()


if __name__ == "__main__":
    sys.exit(entry())
