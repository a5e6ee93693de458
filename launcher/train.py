"""`python -m launcher.train RUN_DIR`: the rank entry's name before launcher/rank/, so that a
command.sh or job.sbatch written then (a queued or requeued Slurm job) still starts its
ranks. New run directories use `python -m launcher.rank`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("launcher.rank", run_name="__main__", alter_sys=True)
