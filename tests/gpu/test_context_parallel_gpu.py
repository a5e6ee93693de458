"""Context parallel on CUDA (issue 51, part d). The project's parallel.cp is DeepSpeed-Ulysses
(launcher/parallel/context.py: all-to-all between a sequence split and a head split), not
torch's ring attention. cp=2 needs 2 ranks, and NCCL takes one GPU per rank:
- with 2+ GPUs: cp=2 against cp=1 on the same 2 ranks and global batch, through the
  launcher: the activation bytes rank 0 saved (train.measure_activations) halve within 15%,
  and each is the planner's figure within 5%;
- with one GPU the cp=2 launch is refused before any rank starts (one line, exit 2), and
  what one device can run is checked instead: the cp code path in one process on CUDA, over
  a real NCCL group of one rank (the all-to-alls, the head split, flash attention on the
  split heads), against the same model without it: the same loss and gradients.
The runs come from scripts/gpu_cases.py. Skipped without a CUDA GPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from gpu_runs import GPUS, ended, gib, log_of, plan_row, record, start
from runs import REPO, read_metrics

sys.path.insert(0, str(REPO / "scripts"))
from gpu_cases import cases  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU")]
RUNS = next(c for c in cases() if c.name == "d-context-parallel").runs
MEASURE = [
    "train.steps=4",
    "optim.warmup_steps=1",
    "logger=none",
    "logger.log_every=1",
    "checkpoint.every=0",
    "checkpoint.save_final=false",
    "train.measure_activations=true",
    "train.activation_checkpointing=none",
]
TITLE = "Context parallel on CUDA (fsdp, gpt_small, seq 2048)"


def launch(root, name: str, overrides: list[str]):
    proc = start(root / name, [*overrides, *MEASURE])
    return root / name, ended(proc, 300)


def test_cp2_against_cp1_or_the_refusal_on_one_gpu(tmp_path):
    nproc = min(GPUS, 2)
    ran = {}
    for name, over in RUNS.items():
        over = [o for o in over if not o.startswith("cluster.nproc_per_node=")] + ["cluster.nproc_per_node=2"]
        ran[name] = launch(tmp_path, name, over)
    if nproc < 2:
        run, code = ran["cp2"]
        log = log_of(run, "cp2")
        record(
            "cp-one-gpu",
            {
                "exit": code,
                "line": log.strip().splitlines()[-1] if log.strip() else "",
                "table": {
                    "title": TITLE,
                    "columns": ["run", "outcome"],
                    "row": [
                        "cp=2 over 2 ranks on 1 GPU",
                        f"exit {code}: " + (log.strip().splitlines() or [""])[-1][:200].replace("|", "/"),
                    ],
                },
            },
        )
        assert code == 2 and "cluster.nproc_per_node" in log, log[-2000:]
        return
    acts = {}
    for name, (run, code) in ran.items():
        assert code == 0, f"{name} exited {code}\n{log_of(run, name)[-4000:]}"
        rows = read_metrics(run)
        acts[name] = next(r["mem/activation_bytes"] for r in rows if "mem/activation_bytes" in r)
        planned = plan_row([*RUNS[name], *MEASURE], world=2).activations
        record(
            f"cp-{name}",
            {
                "activation_bytes": acts[name],
                "planned": planned,
                "table": {
                    "title": TITLE,
                    "columns": ["run", "activation GiB measured", "planned"],
                    "row": [name, gib(acts[name]), gib(planned)],
                },
            },
        )
        assert abs(acts[name] / planned - 1) <= 0.05, (name, acts[name], planned)
    assert abs(acts["cp2"] / acts["cp1"] - 0.5) <= 0.075, acts


def test_the_cp_path_on_cuda_over_a_one_rank_nccl_group():
    import torch.distributed as dist

    from launcher.launch import cli
    from launcher.models import gpt
    from launcher.parallel import context

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29731")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        cfg, _, _ = cli.compose_config(["model=gpt_small", "model.max_seq_len=2048"])
        torch.manual_seed(0)
        model = gpt.GPT(cfg.model).cuda()
        x = torch.randint(0, cfg.model.vocab_size, (2, 2048), device="cuda")
        y = torch.roll(x, -1, dims=1)

        def loss_and_grads():
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(x, y)
            return loss.detach().float(), torch.autograd.grad(loss, list(model.parameters()))

        plain = loss_and_grads()
        assert context.attach(model, dist.group.WORLD) == cfg.model.n_layers
        split = loss_and_grads()
    finally:
        dist.destroy_process_group()
    record(
        "cp-one-rank-path",
        {
            "loss_plain": plain[0].item(),
            "loss_cp_path": split[0].item(),
            "table": {
                "title": TITLE,
                "columns": ["run", "outcome"],
                "row": [
                    "cp path over a 1-rank NCCL group, in one process",
                    f"loss {split[0].item():.5f} vs {plain[0].item():.5f} without",
                ],
            },
        },
    )
    torch.testing.assert_close(split[0], plain[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(split[1], plain[1]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
