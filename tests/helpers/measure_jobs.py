"""Several scripts/measure_memory.py runs in one process group: one launch (torchrun, the
ranks' imports, the gloo group) for what would be one launch each.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/helpers/measure_jobs.py JOBS.json

JOBS.json: a list of measure_memory.py command lines (each with its own --out). Each job
is measured as the script measures it alone (its own cells, engines and scratch folder;
a process builds engines one after another there too) and rank 0 writes its rows to its
--out, with --table its table beside them (OUT.md). tests/e2e/test_plan_runs.py reads them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import measure_memory  # noqa: E402

from launcher.exits import exit_now  # noqa: E402
from launcher.host import deepspeed_env  # noqa: E402


def main() -> None:
    jobs = [measure_memory.parser().parse_args(argv) for argv in json.loads(Path(sys.argv[1]).read_text())]
    deepspeed_env()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for args in jobs:
        printed = measure_memory.report(args, measure_memory.run(args, rank, world), rank, world)
        if printed is not None:
            Path(args.out).with_suffix(".md").write_text(printed + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as a rank: no interpreter teardown, which can abort a finished gloo process
