"""Per-step costs a hand-written loop does not pay, and start-up work nobody asked for
(docs/ARCHITECTURE.md, "Step overhead"): each test fails when the cost comes back."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch.distributed as dist
from runs import REPO

from launcher.rank import preempt


def test_stop_agreement_is_a_collective_about_once_a_second_not_every_step(one_rank_group, monkeypatch):
    """Steps of 10 ms: over 2,000 steps (20 s) the ranks agree about 20 times, not 2,000;
    a signal is acted on at the first check after it, within CHECK_S of steps."""
    clock = [0.0]
    monkeypatch.setattr(preempt.time, "perf_counter", lambda: clock[0])
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(preempt.dist, "all_reduce", lambda t, **kw: (calls.append(t.clone()), real(t, **kw))[1])
    p = preempt.Preemption()
    p.training = True  # the handler would otherwise end the process: a stop before training
    p.started(0)
    stopped_at = None
    for step in range(1, 2001):
        clock[0] += 0.010
        if step == 1500:
            p._handler(signal.SIGTERM, None)
        if p.requested(step):
            stopped_at = step
            break
    checks_before_signal = sum(1 for c in calls if c[0] == 0)
    assert 15 <= checks_before_signal <= 25, checks_before_signal  # 15 s of steps, one check a second
    assert 1500 <= stopped_at <= 1500 + preempt.CHECK_S / 0.010 + 1, stopped_at
    flag, step_us = calls[-1].tolist()
    assert flag == signal.SIGTERM and abs(step_us - 10_000) <= 2  # the slowest rank's step time (µs) rides along


def test_slow_steps_agree_after_every_step(one_rank_group, monkeypatch):
    """Steps longer than CHECK_S (a large model): a check after each, so a stop is never
    more than one step late."""
    clock = [0.0]
    monkeypatch.setattr(preempt.time, "perf_counter", lambda: clock[0])
    p = preempt.Preemption()
    p.training = True
    p.started(10)
    seen = []
    for step in range(11, 16):
        clock[0] += 3.0
        p.requested(step)
        seen.append(p.next_check)
    assert seen == [12, 13, 14, 15, 16]


def test_ranks_import_only_what_their_recipe_and_logger_use():
    """A rank of a ddp run with logger=none imports neither DeepSpeed, transformers, W&B,
    TensorBoard nor Hydra (it reads config.yaml; the launch side composed it)."""
    code = (
        "import sys\nimport launcher.rank.entry, engines\nengines.engine('ddp')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'deepspeed', 'transformers', 'wandb', 'tensorboard', 'hydra', 'datasets'}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_fsdp_gathers_the_root_once_a_step(one_rank_group):
    """The blocks reshard after forward (recipe.fsdp.reshard_after_forward); the root
    (embedding, final norm, head), which is held gathered through forward and backward
    either way, does not: resharding it cost an all-gather of the largest group every
    step, which the hand-written FSDP2 loop (torch's default for the root) does not pay."""
    import torch

    from launcher.launch.compose import compose_config
    from launcher.models import decoder_layers, on_meta
    from launcher.parallel import degrees as D
    from launcher.parallel.mesh import build_mesh, parallelize

    for blocks in (True, False):
        cfg = compose_config(["recipe=fsdp", "model=gpt_tiny", f"recipe.fsdp.reshard_after_forward={blocks}"])[0]
        model = on_meta(cfg)
        deg = D.degrees(cfg, 1)
        parallelize(model, build_mesh(deg, torch.device("cpu")), deg, cfg)
        resharded = lambda m: m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None  # noqa: E731
        assert [resharded(b) for b in decoder_layers(model)] == [blocks] * cfg.model.n_layers
        assert not resharded(model)


def test_fsdp_holds_an_untied_embedding_gathered_and_the_planner_counts_it(one_rank_group):
    """After forward the root unit's parameters are the gathered ones (an untied embedding
    too, which autograd does not save) while a block's are shards again; the planner's
    temporaries hold the embedding's gathered copy for untied models only."""
    import dataclasses

    import torch
    from torch.distributed.tensor import DTensor

    from launcher import models
    from launcher.launch.compose import compose_config
    from launcher.parallel import degrees as D
    from launcher.parallel.mesh import build_mesh, parallelize
    from launcher.planner import plan as planner
    from launcher.planner.footprint import temporaries

    cfg = compose_config(["recipe=fsdp", "model=gpt_tiny", "model.tie_embeddings=false", "precision=fp32"])[0]
    model = models.prepare(models.on_meta(cfg), cfg)
    deg = D.degrees(cfg, 1)
    parallelize(model, build_mesh(deg, torch.device("cpu")), deg, cfg)
    models.materialize(model, cfg, torch.device("cpu"))
    x = torch.randint(0, cfg.model.vocab_size, (2, 17))
    loss = model(x[:, :-1], x[:, 1:])
    assert not isinstance(model.tok_embeddings.weight, DTensor)  # gathered, held until backward
    assert isinstance(models.decoder_layers(model)[0].attention.wq.weight, DTensor)  # resharded
    loss.backward()
    assert isinstance(model.tok_embeddings.weight, DTensor)  # resharded after backward

    layout = planner.layout_for(cfg, 1)
    m, b, s = cfg.model, 2, 16
    untied = temporaries(m, cfg.precision.name, layout, cfg.train.activation_checkpointing, 2, b, s)
    tied = temporaries(
        dataclasses.replace(m, tie_embeddings=True),
        cfg.precision.name,
        layout,
        cfg.train.activation_checkpointing,
        2,
        b,
        s,
    )
    assert untied - tied == 4 * m.vocab_size * m.dim  # fp32: the gathered embedding in fp32


@pytest.mark.parametrize(
    "visible, installed, want",
    [
        (None, 8, 8),
        ("0,1", 8, 2),
        ("3", 8, 1),
        ("", 8, 0),
        ("-1", 8, 0),
        ("0,9,1", 8, 1),  # CUDA stops at the first ordinal it does not have
        ("1,1", 8, 1),  # or sees again
        ("GPU-8d9c7c6e-0f5e-4c6a-9b1e-0123456789ab", 8, None),  # by UUID: only CUDA can tell
        ("0,1", None, None),  # no /proc/driver/nvidia/gpus: ROCm, WSL
    ],
)
def test_the_launch_side_counts_gpus_without_torch(visible, installed, want):
    """HostInfo.detect on a host with a GPU driver: the GPUs CUDA will show, from the
    driver's count and CUDA_VISIBLE_DEVICES, so a launch on a GPU host imports no torch
    either; None sends it to torch.cuda.device_count()."""
    from launcher.host import visible_gpus

    assert visible_gpus(visible, installed) == want


@pytest.mark.parametrize(
    "name,tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10G", 70.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA A40", 149.7),
        ("NVIDIA A30", 165.0),
        ("Tesla V100-SXM2-32GB", 125.0),
        ("Tesla T4", 65.0),
        ("NVIDIA B200", 2250.0),
        ("AMD Instinct MI300X", 1307.0),
        ("NVIDIA GeForce RTX 4090", None),
        ("", None),
    ],
)
def test_peak_flops_by_the_exact_device_name(name, tflops):
    """MFU's denominator: an L40S is not an L4, an H100 NVL or PCIe not the SXM (the table
    once matched by substring); a GPU not in the table is None (the rank warns, and
    cluster.peak_tflops sets it)."""
    from launcher.host import table_tflops

    assert table_tflops(name) == tflops


@pytest.mark.parametrize("recipe", ["ddp", "fsdp"])
def test_a_step_reads_nothing_back_from_the_device(one_rank_group, tmp_path, recipe):
    """No `.item()` or `float(tensor)` in an engine's step (a host synchronisation on a GPU,
    every step): torch's profiler sees no aten::_local_scalar_dense in three steps, outside
    torch's own AdamW (its step counters live on the host). DeepSpeed's step reads 5 values
    (zero2) and about 90 (zero3) of its own, the same in the hand-written DeepSpeed loop."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from launcher import models
    from launcher.data.read import build_dataset
    from launcher.launch.compose import compose_config
    from launcher.rank.entry import build_engine

    cfg, _, _ = compose_config(
        [
            f"recipe={recipe}",
            "model=gpt_tiny",
            "train.seq_len=64",
            "train.micro_batch=2",
            "precision=fp32",
            "logger=none",
            "cluster.nproc_per_node=1",
        ]
    )
    engine = build_engine(cfg, models.prepare(models.on_meta(cfg), cfg), torch.device("cpu"), 0, 1, 0, tmp_path)
    b = build_dataset(cfg).__getitems__([0, 1])
    engine.train_step([(b[:, :-1], b[:, 1:])])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.train_step([(b[:, :-1], b[:, 1:])])
    events = prof.events()
    optimizer = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("Optimizer.step#")]
    reads = [
        e
        for e in events
        if e.name == "aten::_local_scalar_dense"
        and not any(start <= e.time_range.start <= end for start, end in optimizer)
    ]
    assert optimizer and not reads, f"{len(reads)} host reads in 3 steps"


def test_a_logged_step_reads_its_scalars_in_one_copy():
    """The loop's logged step reads loss, gradient norm, loss scale and skipped steps in one
    device-to-host copy (launcher.device.host_values); Python numbers pass through."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from launcher.device import host_values

    seen = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    values = (torch.tensor(2.5), 0.75, torch.tensor(65536.0), torch.tensor(3))
    with Reads():
        got = host_values(torch.device("cpu"), *values)
    assert got == [2.5, 0.75, 65536.0, 3.0]
    assert torch.ops.aten._local_scalar_dense.default not in seen  # no .item(): one stack, one tolist()
    assert sum(f is torch.ops.aten.stack.default for f in seen) == 1
