"""`launcher rehearse` on a small layout, in a real process: ranks built on the meta
device under a fake process group, with the local shapes tensor parallel and FSDP give
each rank and the planner beside them (the cluster-sized matrix: tests/e2e/test_rehearse_runs.py;
the rehearsal against real ranks' engines: tests/e2e/test_plan_runs.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from runs import REPO

from launcher.parallel import degrees as D
from launcher.planner import rehearse as R


def test_the_chosen_ranks_cover_ends_stages_tensor_and_expert_parallel_positions():
    assert R.chosen_ranks(D.Degrees(dp_shard=64)) == [0, 63]
    assert R.chosen_ranks(D.Degrees(dp_shard=32, tp=8)) == [0, 1, 2, 3, 4, 5, 6, 7, 255]
    assert R.chosen_ranks(D.Degrees(pp=4, dp_replicate=16)) == [0, 16, 32, 48, 63]
    assert R.chosen_ranks(D.Degrees(dp_shard=256, ep=64)) == [0, 63, 255]


def test_a_rehearsal_reports_each_ranks_shards_and_the_plan():
    """gpt_tiny (dim 128, 4 heads, ffn 384, vocabulary 256, tied) as tp_fsdp with tp=2 on 2
    nodes of 4: 8 ranks, FSDP over 4. Rank 0 and rank 1 are the two tensor-parallel
    positions; rank 7 the last."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "rehearse",
            "model=gpt_tiny",
            "recipe=tp_fsdp",
            "parallel.tp=2",
            "cluster.nnodes=2",
            "cluster.gpus_per_node=4",
            "cluster.gpu_memory_gb=8",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert (out["world"], out["layout"]["label"], out["fits"]) == (8, "tp_fsdp (dp4 tp2)", True)
    assert [r["rank"] for r in out["ranks"]] == [0, 1, 7]
    for r in out["ranks"]:
        shards = {s["name"]: s for s in r["shards"]}
        # q: rows split by tensor parallel (128 -> 64), then by FSDP over 4 (-> 16)
        assert shards["layers.*.attention.wq.weight"]["local"] == [16, 128]
        assert shards["layers.*.attention.wq.weight"]["count"] == 4
        # the output projection: columns by tensor parallel, rows by FSDP
        assert shards["layers.*.attention.wo.weight"]["local"] == [32, 64]
        # the norms are replicated by tensor parallel, sharded by FSDP; so is the tied embedding
        assert shards["norm.weight"]["local"] == [32]
        assert shards["tok_embeddings.weight"]["local"] == [64, 128]
        # the optimizer's own states: two fp32 Adam moments of every local shard (and a step each)
        assert 2 * r["params"] <= r["optim"] < 2 * r["params"] + 4 * 100
        assert abs(r["difference"]) < R.TOLERANCE, r
    proc = subprocess.run(
        [sys.executable, "-m", "launcher", "rehearse", "model=gpt_tiny", "recipe=fsdp", "cluster.gpus_per_node=4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert text.splitlines()[0].startswith("rehearsal: model=gpt_tiny, fsdp (dp4) on 4 ranks (1 node(s) x 4)")
    assert text.splitlines()[-1].startswith("largest difference: ") and "within 2%" in text.splitlines()[-1]


def test_pipeline_stages_with_tensor_parallel_and_fsdp_are_rehearsed():
    """pp=2 x tp=2 x fsdp=2 (recipe pp_fsdp) on 2 nodes of 4: every stage's first rank,
    both tensor-parallel positions and the last rank, each holding its stage's layers
    split by tensor parallel, then by FSDP, as the planner says."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "rehearse",
            "model=gpt_tiny",
            "recipe=pp_fsdp",
            "parallel.tp=2",
            "cluster.nnodes=2",
            "cluster.gpus_per_node=4",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert (out["world"], out["layout"]["label"]) == (8, "pp_fsdp (dp2 tp2 pp2)")
    assert [r["rank"] for r in out["ranks"]] == [0, 1, 4, 7]
    for r in out["ranks"]:
        shards = {s["name"]: s for s in r["shards"]}
        assert shards["layers.*.attention.wq.weight"]["local"] == [32, 128]  # 128 rows / tp 2 / fsdp 2
        first = r["coords"]["pp"] == 0
        assert ("tok_embeddings.weight" in shards) == first and ("output.weight" in shards) == (not first)
        assert abs(r["difference"]) < R.TOLERANCE, r


def test_a_hugging_face_llama_is_rehearsed_against_the_plan_of_its_shape(tmp_path):
    """model=hf (a tiny Llama's config.json): the engine builds transformers' model; the
    planner reads it as the project's decoder of the same shape, as `make plan` does."""
    from hf_models import tiny_llama_config

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "rehearse",
            "model=hf",
            f"model.config={tiny_llama_config(tmp_path)}",
            "recipe=tp_fsdp",
            "parallel.tp=2",
            "cluster.gpus_per_node=4",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert [r["rank"] for r in out["ranks"]] == [0, 1, 3]
    assert all(abs(r["difference"]) < R.TOLERANCE and r["params"] > 0 for r in out["ranks"]), out["ranks"]
    names = {s["name"] for s in out["ranks"][0]["shards"]}
    assert "model.layers.*.self_attn.q_proj.weight" in names, names


def test_tensor_parallel_ranks_hold_the_whole_vocabularys_logits():
    """The planner's logits term is not divided by tp: a rank of a tp=2 layout, built as a
    rehearsal builds it (meta device, fake process group), gathers the head's output to the
    whole vocabulary before the loss, tied or untied."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from launcher import models
    from launcher.launch import cli
    from launcher.planner import footprint
    from launcher.planner import plan as planner
    from launcher.rank.entry import build_engine

    for tied in ("true", "false"):
        cfg, _, _ = cli.compose_config(
            ["model=gpt_tiny", "recipe=tp", "parallel.tp=2", "cluster.gpus_per_node=2", f"model.tie_embeddings={tied}"]
        )
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
        try:
            engine = build_engine(cfg, models.prepare(models.on_meta(cfg), cfg), torch.device("meta"), 1, 2, 1, REPO)
            x = torch.zeros(3, 16, dtype=torch.long, device="meta")
            logits = engine.model(x)
        finally:
            dist.destroy_process_group()
        assert not isinstance(logits, torch.distributed.tensor.DTensor) and tuple(logits.shape) == (3, 16, 256), tied
    layout = planner.layout_of(cfg, D.degrees(cfg, 2))
    assert (
        footprint.temporaries(
            cfg.model, cfg.precision.name, layout, cfg.train.activation_checkpointing, cfg.train.ac_every, 3, 16
        )
        >= (2 + 4) * 3 * 16 * 256
    )
