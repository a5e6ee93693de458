"""ZeRO-3's gathered working set (launcher/planner/gathered.py) against DeepSpeed's own count:
the coordinator's `__n_available_params` (the elements it holds gathered, what its
stage3_max_live_parameters cap reads) after each module's fetch and prefetch, on one rank of
gloo, for a tiny decoder with the thresholds lowered until each rule acts: a head larger than
max_live, a prefetch bucket that overshoots, a reuse window shorter than the step."""

from __future__ import annotations

import sys

import pytest
import torch

from launcher import models
from launcher.data.read import build_dataset
from launcher.launch.compose import compose_config
from launcher.parallel import ds_config
from launcher.planner import gathered as G
from launcher.rank.entry import build_engine


@pytest.fixture(scope="module")
def one_group(tmp_path_factory):
    """One gloo group of one rank for the file (as tests/unit/test_step_peak.py: DeepSpeed keeps the first group)."""
    import torch.distributed as dist

    from launcher.planner.rehearse import leave_group

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path_factory.mktemp('group') / 'store'}", rank=0, world_size=1
    )
    yield
    leave_group(zero3="deepspeed" in sys.modules)


def counted(engine, cfg, threshold: int) -> list[tuple[str, bool, int]]:
    """(module, forward?, DeepSpeed's gathered elements) after each fetch of a module with a
    parameter above the persistence threshold, over one step."""
    coordinator = engine.engine.optimizer.parameter_offload.get_param_coordinator()
    fetch, seen = coordinator.fetch_sub_module, []
    names = {id(m): n for n, m in engine.model.named_modules()}

    def recording(module, forward):
        fetch(module, forward)
        if any(p.ds_numel > threshold for p in module.parameters(recurse=False)):
            seen.append((names[id(module)], forward, coordinator._PartitionedParameterCoordinator__n_available_params))

    coordinator.fetch_sub_module = recording
    b = build_dataset(cfg).__getitems__(list(range(cfg.train.micro_batch)))
    engine.train_step([(b[:, :-1], b[:, 1:])])
    coordinator.fetch_sub_module = fetch
    return seen


CASES = {  # vocab, max_live, prefetch, reuse (gpt_tiny: dim 128, a block 212,992 elements)
    "defaults": (1024, 1_000_000_000, None, 1_000_000_000),
    "head over max_live": (2048, 200_000, 60_000, 100_000),
    "prefetch overshoots": (1024, 400_000, 10_000, 300_000),
    "short reuse window": (1024, 1_000_000, 212_992, 50_000),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_replay_counts_what_deepspeed_gathers(one_group, tmp_path, monkeypatch, case):
    vocab, live, prefetch, reuse = CASES[case]
    cfg = compose_config(
        [
            "recipe=zero3",
            "model=gpt_tiny",
            "model.tie_embeddings=false",
            f"model.vocab_size={vocab}",
            "train.seq_len=32",
            "train.micro_batch=1",
            "precision=fp32",
            "logger=none",
            "cluster.nproc_per_node=1",
            "train.activation_checkpointing=none",
            f"recipe.zero.max_live_parameters={live}",
            f"recipe.zero.max_reuse_distance={reuse}",
            *([f"recipe.zero.prefetch_bucket_size={prefetch}"] if prefetch else []),
        ]
    )[0]
    (tmp_path / ds_config.FILE).write_text(ds_config.text(ds_config.launch_config(cfg, 1, False)))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)  # zero.Init replaces it
    engine = build_engine(cfg, models.prepare(models.on_meta(cfg), cfg), torch.device("cpu"), 0, 1, 0, tmp_path)
    threshold = ds_config.persistence_threshold(cfg)
    counted(engine, cfg, threshold)  # the first step records the trace; prefetching starts on the second
    real = counted(engine, cfg, threshold)
    steps = {(name, fwd): ps for name, fwd, ps in G.trace(cfg.model, threshold)}
    replayed = [
        (s.module, s.forward, s.held)
        for s in G.replay(cfg.model, live, ds_config.prefetch_bucket(cfg), reuse, threshold)
        if steps[s.module, s.forward]
    ]
    print(case, "deepspeed", real, "replay", replayed)
    assert replayed == real
