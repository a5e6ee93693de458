"""A rank's region of a sharded parameter, at layouts too big to launch here: each rank of
a real fully_shard / parallelize_module on the meta device, under torch's fake process
group (one process per rank, no communication), fills its region, which must equal that
region of the tensor drawn whole at world size 1, and the regions together cover the
tensor (launcher/models/init.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from runs import REPO

pytestmark = pytest.mark.slow  # a process per rank

SCRIPT = r"""
import sys, torch, torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
from torch.distributed.fsdp import fully_shard
from launcher.models.init import InitSpec, fill, local_part

rows, cols, dp, tp, rank = map(int, sys.argv[1:6])
spec = InitSpec(std=0.02)
whole = {}
for name, shape in (("0.weight", (rows, cols)), ("1.weight", (cols, rows))):
    t = torch.empty(shape)
    fill(t, shape, tuple((0, n) for n in shape), None, spec, 0, name, torch.device("cpu"))
    whole[name] = t
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * tp)
mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
with torch.device("meta"):
    m = nn.Sequential(nn.Linear(cols, rows, bias=False), nn.Linear(rows, cols, bias=False))
if tp > 1:
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
if dp > 1:
    fully_shard(m, mesh=mesh["dp"])
m.to_empty(device="cpu")
for name, p in m.named_parameters():
    dst, shape, box, _ = local_part(p)
    fill(dst, shape, box, None, spec, 0, name, torch.device("cpu"))
    assert torch.equal(dst, whole[name][tuple(slice(a, b) for a, b in box)]), (rank, name, box)
    print(name, *(x for ab in box for x in ab))
dist.destroy_process_group()
"""


def run(rows: int, cols: int, dp: int, tp: int) -> None:
    import torch

    seen = {
        "0.weight": torch.zeros(rows, cols, dtype=torch.int64),
        "1.weight": torch.zeros(cols, rows, dtype=torch.int64),
    }
    for rank in range(dp * tp):
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, *map(str, (rows, cols, dp, tp, rank))],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        for line in proc.stdout.splitlines():
            name, a0, b0, a1, b1 = line.split()
            seen[name][int(a0) : int(b0), int(a1) : int(b1)] += 1
    for name, count in seen.items():  # every element is held, by each tensor-parallel replica at most once
        assert int(count.min()) >= 1 and int(count.max()) <= tp, (name, int(count.min()), int(count.max()))


def test_uneven_two_dimensional_shards_hold_the_whole_tensors_values():
    """49153 rows over tp 2 x dp 3: FSDP chunks each tensor-parallel half again, and the
    last data-parallel rank of each half holds fewer rows (DTensor's own offset helper
    places it one row off)."""
    run(49153, 24, 3, 2)


def test_uneven_fsdp_alone():
    run(1001, 16, 3, 1)  # ceil-sized chunks, the last one short
