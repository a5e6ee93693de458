"""The pure parts of the parallel recipes: degrees and rank layout, pipeline stage cuts,
the tensor-parallel plan's coverage, checkpoint key names. (End to end:
tests/e2e/test_parallel_train.py.)"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from launcher.host import HostInfo
from launcher.launch import cli
from launcher.launch.checks.validate import validate
from launcher.models import Layout
from launcher.models.gpt import GPT
from launcher.parallel import degrees as D
from launcher.parallel.cuts import Stage, stage_bounds, tp_plan
from launcher.parallel.dcp import _canonical

HOST = HostInfo.detect()


def compose(*overrides):
    cfg, _, _ = cli.compose_config(list(overrides))
    return cfg


@pytest.mark.parametrize(
    "overrides,world,want",
    [
        (["recipe=ddp"], 2, D.Degrees(dp_replicate=2)),
        (["recipe=fsdp"], 4, D.Degrees(dp_shard=4)),
        (["recipe=fsdp", "parallel.dp_replicate=2"], 4, D.Degrees(dp_replicate=2, dp_shard=2)),
        (["recipe=tp", "parallel.tp=2"], 4, D.Degrees(dp_replicate=2, tp=2)),  # tp does not shard: replicas
        (["recipe=tp_fsdp", "parallel.tp=2"], 8, D.Degrees(dp_shard=4, tp=2)),
        (["recipe=pp", "parallel.pp=2"], 4, D.Degrees(pp=2, dp_replicate=2)),
        (["recipe=ddp", "parallel.cp=2"], 4, D.Degrees(dp_replicate=2, cp=2)),
        (["recipe=fsdp", "parallel.cp=2"], 4, D.Degrees(dp_shard=2, cp=2)),
        (["recipe=tp_fsdp", "parallel.tp=2", "parallel.cp=2"], 8, D.Degrees(dp_shard=2, cp=2, tp=2)),
    ],
)
def test_degrees_give_the_rest_to_data_parallel(overrides, world, want):
    cfg = compose(*overrides)
    assert D.degrees(cfg, world) == want
    assert D.data_parallel_size(cfg, world) == want.dp == world // (want.tp * want.pp * want.cp)


def test_rank_coordinates_are_row_major_over_the_mesh():
    d = D.Degrees(pp=2, dp_replicate=1, dp_shard=2, tp=2)
    coords = [d.coords(r) for r in range(d.world)]
    assert coords == list(
        itertools.product(range(2), range(1), range(2), range(1), range(2))
    )  # init_device_mesh's order
    # tensor-parallel neighbours and pipeline stages of one replica read the same data
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # context-parallel ranks (between data and tensor parallel) read the same samples, other positions
    c = D.Degrees(dp_shard=2, cp=2, tp=2)
    assert [c.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [c.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_the_issue_commands_validate():
    for overrides, nproc in [
        (["recipe=fsdp"], 2),
        (["recipe=tp", "parallel.tp=2"], 2),
        (["recipe=pp", "parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=8"], 2),
        (["recipe=tp_fsdp", "parallel.tp=2"], 4),
        (["recipe=fsdp"], 4),
    ]:
        cfg = compose(*overrides, f"cluster.nproc_per_node={nproc}")
        validate(cfg, HOST)


def _brute_force_best(model, n_stages):
    n, costs = len(model.layers), []
    for cut in itertools.combinations(range(1, n), n_stages - 1):
        bounds = list(zip([0, *cut], [*cut, n]))
        costs.append(max(_stage_params(model, a, b) for a, b in bounds))
    return min(costs)


def _stage_params(model, a, b):
    return sum(p.numel() for p in Stage(model, range(a, b)).parameters())  # counted from the modules


@pytest.mark.parametrize(
    "model,n_stages", [("gpt_tiny", 2), ("gpt_tiny", 4), ("gpt_small", 4), ("gpt_1b", 4), ("gpt_small", 3)]
)
def test_balanced_stages_minimise_the_largest_stage(model, n_stages):
    m = compose(f"model={model}").model
    with torch.device("meta"):
        gpt = GPT(m)
    bounds = stage_bounds(m, n_stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == m.n_layers and len(bounds) == n_stages
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    assert max(_stage_params(gpt, a, b) for a, b in bounds) == _brute_force_best(gpt, n_stages)


def test_user_split_is_taken_as_given():
    m = compose().model
    assert stage_bounds(m, 2, [3]) == [(0, 3), (3, 4)]
    assert stage_bounds(m, 4, [1, 2, 3]) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("tied", [True, False])
def test_stages_chained_are_the_model(tied):
    m = compose(f"model.tie_embeddings={str(tied).lower()}").model
    torch.manual_seed(0)
    model = GPT(m)
    model.checkpointed = {1}
    stages = [Stage(model, range(a, b)) for a, b in stage_bounds(m, 3)]
    x = torch.randint(0, m.vocab_size, (2, 16))
    h = x
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, model(x))
    # names are the full model's; together the stages hold every parameter
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert len(names) == len(set(names))
    assert set(names) == set(model.state_dict())  # a tied head: the embedding on the first, the head on the last


def test_tensor_parallel_plan_covers_every_matmul_and_norm():
    for tied, sp in itertools.product([True, False], [True, False]):
        m = compose(f"model.tie_embeddings={str(tied).lower()}").model
        root, block = tp_plan(Layout(tied=tied), sp)
        model = GPT(m)
        layer = model.layers[0]
        leaves = {n for n, mod in layer.named_modules() if isinstance(mod, nn.Linear) or "norm" in n}
        assert leaves <= set(block), leaves - set(block)
        assert {"tok_embeddings", "norm", "output"} <= set(root)
        for name in [*block]:
            layer.get_submodule(name)  # every plan entry names a real module


TIED = Layout().tied_names()  # ("output.weight", "tok_embeddings.weight")


def test_a_tied_head_is_stored_once_under_the_embedding_name():
    a, b = torch.zeros(2), torch.ones(2)
    assert _canonical({"tok_embeddings.weight": a, "output.weight": a, "norm.weight": b}, tied=TIED) == {
        "tok_embeddings.weight": a,
        "norm.weight": b,
    }
    # the last pipeline stage holds the head only
    got = _canonical({"output.weight": a}, tied=TIED)
    assert list(got) == ["tok_embeddings.weight"] and got["tok_embeddings.weight"] is a
    got = _canonical({"state.output.weight.exp_avg": a, "state.norm.weight.step": b}, tied=TIED, prefix="state.")
    assert set(got) == {"state.tok_embeddings.weight.exp_avg", "state.norm.weight.step"}
    assert _canonical({"output.weight": a, "tok_embeddings.weight": b}, tied=None) == {
        "output.weight": a,
        "tok_embeddings.weight": b,
    }


def test_ddp_skips_the_buffer_sync_on_either_torch(monkeypatch):
    """forward_sync_buffers=False from torch 2.13; torch 2.11's DDP has only broadcast_buffers
    (every ddp run failed on the H200 with the newer keyword, bench/gpu.md)."""
    from engines.ddp import engine

    assert engine.no_buffer_sync() == {"forward_sync_buffers": False}

    class OlderDDP:  # torch 2.11's signature, as far as these keywords go
        def __init__(
            self,
            module,
            device_ids=None,
            broadcast_buffers=True,
            bucket_cap_mb=None,
            gradient_as_bucket_view=False,
            static_graph=False,
        ):
            pass

    monkeypatch.setattr(engine, "DDP", OlderDDP)
    assert engine.no_buffer_sync() == {"broadcast_buffers": False}
