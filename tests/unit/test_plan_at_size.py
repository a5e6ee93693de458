"""The plan at the sizes users run (issue 49): terms that only show beyond DeepSpeed's
thresholds (ZeRO-3's 1e9-element sub-groups), checked on plans of Llama 3 70B / 405B and
gpt_7b, against DeepSpeed's own code and defaults where it can run without ranks."""

from __future__ import annotations

import types

import pytest

from launcher.config import shape_key
from launcher.launch import cli, compose
from launcher.planner import plan as planner
from launcher.planner import zero as Z
from launcher.planner.footprint import model_states, start_up
from launcher.planner.memory import ParamCounts

GB = 1e9


def composed(*overrides: str):
    return cli.compose_config(["precision=bf16", *overrides])[0]


def hardware(gpus: int, gpu_gb: float = 141) -> planner.Hardware:
    return planner.Hardware(
        gpu_bytes=int(gpu_gb * 2**30),
        gpus_per_node=min(gpus, 8),
        nnodes=max(1, gpus // 8),
        tflops=planner.DEFAULT_TFLOPS,
    )


def deepspeed_sub_groups(cfg, world: int, size: int) -> list[int]:
    """DeepSpeed's own cut (stage3.py `_create_fp16_sub_groups`) of each optimizer group
    (matrices, then vectors, as the engine hands them over) into sub-groups, on stand-ins
    that answer partition_numel() as a ZeRO-3 parameter does (ceil(numel / N))."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    out = []
    for sizes in Z._group_sizes(shape_key(cfg.model)):
        params = [types.SimpleNamespace(partition_numel=lambda n=n: -(-n // world)) for n in sizes]
        for group in Stage3._create_fp16_sub_groups(types.SimpleNamespace(sub_group_size=size), params):
            out.append(sum(p.partition_numel() for p in group))
    return out


def test_the_sub_group_defaults_are_deepspeeds():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for key, value in Z.DEFAULTS.items():
        assert DeepSpeedZeroConfig.model_fields[key].default == value, key


@pytest.mark.parametrize("model,gpus", [("llama3_70b", 8), ("gpt_7b", 1), ("llama3_70b", 16), ("llama3_405b", 64)])
def test_zero3_charges_the_fp32_gradient_per_sub_group(model, gpus):
    """Ψ/N above DeepSpeed's 1e9-element sub-groups: the step's fp32 gradient is one
    sub-group's (4S), the largest of DeepSpeed's own cut, not the partition's (4Ψ/N).
    Llama 3 70B on 8 ranks: 145 GB of states, where 4Ψ/N would have made them 176."""
    cfg = composed(f"model={model}", "recipe=zero3")
    layout = planner.layout_for(cfg, gpus)
    psi = ParamCounts.of(cfg.model).total
    S = Z.sub_group(cfg, gpus, psi)
    assert S == max(deepspeed_sub_groups(cfg, gpus, Z.DEFAULTS["sub_group_size"]))
    assert psi / gpus > 4 * S
    params, grads, optim, _, _ = model_states(cfg, layout)
    bucket = cfg.model.dim**2
    assert grads == pytest.approx(2 * psi / gpus + 4 * S + 2 * bucket, abs=16)
    whole = Z.zero_states(3, psi, gpus, bucket=bucket, kept_whole=0, weight_bytes=2)  # the partition at once
    assert sum(d + h for d, h in whole.values()) - (params + grads + optim) > 0.15 * (params + grads + optim)
    if (model, gpus) == ("llama3_70b", 8):
        assert 140 * GB < params + grads + optim < 150 * GB
    # the set-up's gradient buffer is one sub-group's too (stage3.py initialize_optimizer_states)
    assert start_up(cfg, layout)[0] == 2 * psi // gpus * 2 + 4 * psi // gpus + 4 * S


def test_sub_group_size_moves_the_plan_as_it_moves_the_engine():
    """recipe.zero.extra.zero_optimization.sub_group_size, smaller and larger than the
    partition: the planned fp32 gradient follows DeepSpeed's cut at each."""
    grads = {}
    for size in (10**8, 10**9, 10**12):
        cfg = composed(
            "model=llama3_70b", "recipe=zero3", f"+recipe.zero.extra={{zero_optimization:{{sub_group_size:{size}}}}}"
        )
        psi = ParamCounts.of(cfg.model).total
        assert Z.sub_group(cfg, 8, psi) == max(deepspeed_sub_groups(cfg, 8, size))
        grads[size] = model_states(cfg, planner.layout_for(cfg, 8))[1]
    assert grads[10**8] < grads[10**9] < grads[10**12]
    assert grads[10**12] == pytest.approx(6 * psi / 8 + 2 * cfg.model.dim**2, rel=1e-3)  # one sub-group: the partition


def test_gpt_7b_on_one_141_gb_gpu_fits_zero3():
    """The issue's example: no zero3 row fit (149.48 GB against 149.25) while DeepSpeed's
    sub-groups hold the fp32 gradient to 4 GB of the 27 the plan charged."""
    cfg = composed("model=gpt_7b", "train.seq_len=4096")
    rows = planner.plan(cfg, hardware(1), compose.recipe_configs({"zero3"}))
    assert any(r.fits for r in rows if r.layout.recipe == "zero3")


def test_zero2_offload_keeps_the_upload_copy_in_host_memory():
    """DeepSpeed makes the 16-bit copy of the shard (temp_buffer_bit16) on the master shard's
    device, the CPU, and pins it (stage_1_and_2.py): 2Ψ/N host bytes, not device bytes.
    gpt_7b on one GPU: 13.5 GB off the device, onto the host."""
    cfg = composed("model=gpt_7b", "recipe=zero2_offload")
    psi = ParamCounts.of(cfg.model).total
    for gpus in (1, 8):
        layout = planner.layout_for(cfg, gpus)
        params, _, _, where, host = model_states(cfg, layout)
        assert (params - host["params"], host["params"]) == (2 * psi, 2 * psi // gpus)
        assert where["params"] == "device+cpu"
        device, host_bytes = start_up(cfg, layout)
        largest = 2 * Z.largest_param(cfg.model)
        assert (device, host_bytes) == (2 * psi + largest, 8 * psi // gpus + 2 * psi // gpus + largest)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_sequence_parallel_splits_the_norms_and_the_stream_over_tp(ac):
    """gpt_7b at tp8, seq 4096 (the issue's rows): parallel.sequence_parallel divides by tp
    what runs on the sequence-split stream (Korthikanti et al. 2022, 4.2.2): the two norms of
    each block and the final norm, and a recomputed block's input; the projections still save
    the gathered sequence. Measured on real ranks: tests/e2e/test_plan_runs.py."""
    from launcher.config import ACMode
    from launcher.planner import memory as M
    from launcher.planner.footprint import activations, numerics

    off, on = (
        composed("model=gpt_7b", "recipe=tp", "parallel.tp=8", "train.seq_len=4096", f"parallel.sequence_parallel={sp}")
        for sp in ("false", "true")
    )
    layout = planner.layout_for(on, 8)
    x, n = M.Shape.of(on.model, 1, 4096), numerics(on.precision.name, layout)
    saved = {"none": (2 * x.L + 1) * M._norm(x, n), "full": x.L * n.residual * x.s * x.h + M._norm(x, n)}[ac]
    diff = activations(off, layout, ACMode(ac), 1) - activations(on, layout, ACMode(ac), 1)
    assert diff == saved - saved // 8 and diff > 0


def test_auto_micro_batch_divides_the_global_batch_at_size():
    """gpt_7b on 8 x 80 GB with train.global_batch=96: every row's micro-batch divides its
    data-parallel rank's share (12 at dp8, 24 at dp4 ...), the largest such that fits; with
    the global batch unset, some rows fit a micro-batch that would not divide it."""
    free = composed("model=gpt_7b", "train.seq_len=2048")
    fixed = composed("model=gpt_7b", "train.seq_len=2048", "train.global_batch=96")
    recipes = compose.recipe_configs({"fsdp", "zero3", "tp_fsdp"})
    unset = {(r.layout.label, r.ac): r for r in planner.plan(free, hardware(8, 80), recipes)}
    rows = planner.plan(fixed, hardware(8, 80), recipes)
    assert any(r.fits for r in rows)
    for r in (r for r in rows if r.fits):
        share = 96 // r.layout.dp
        assert share % r.micro_batch == 0 and r.micro_batch <= unset[(r.layout.label, r.ac)].micro_batch
        bigger = [b for b in range(r.micro_batch + 1, share + 1) if share % b == 0]
        assert not bigger or not planner.fits(
            fixed,
            hardware(8, 80),
            planner.memory_row(
                planner.at_batch(fixed, r.layout, bigger[0]), r.layout, r.ac, bigger[0], hardware(8, 80)
            ),
        )
    assert any(96 // r.layout.dp % r.micro_batch for r in unset.values() if r.fits)


def test_auto_micro_batch_with_a_global_batch_launches(capsys):
    """The issue's `make train ARGS="train.micro_batch=auto train.global_batch=16"` on 2
    ranks: the planner chose 1024 (what fits this machine) and the launch refused its own
    choice. Now it chooses a micro-batch that divides 16 / 2, and the launch's check passes."""
    from launcher.host import HostInfo
    from launcher.launch.checks.validate import validate
    from launcher.launch.commands.plan import resolve_auto

    host = HostInfo.detect()
    chosen, _ = resolve_auto(
        ["train.micro_batch=auto", "train.global_batch=16", "cluster.nproc_per_node=2", "precision=fp32"], host
    )
    cfg = cli.compose_config(chosen)[0]
    validate(cfg, host)
    assert cfg.train.micro_batch == 8 and "planner chose" in capsys.readouterr().out  # gpt_small x 8 fits here


def test_the_reference_table_in_the_docs_is_current():
    """docs/memory.md's table against the ZeRO paper, DeepSpeed's estimators and Korthikanti
    et al.: regenerated (scripts/zero_table.py) and compared, so it cannot drift from the planner."""
    import importlib.util

    from runs import REPO

    spec = importlib.util.spec_from_file_location("zero_table", REPO / "scripts" / "zero_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    doc = (REPO / "docs" / "memory.md").read_text()
    assert doc[doc.index(script.BEGIN) : doc.index(script.END) + len(script.END)] == script.table()
