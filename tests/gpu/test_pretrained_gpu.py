"""Pretrained weights read shard-wise straight into CUDA tensors (issue 51, part e): a Llama
written by save_pretrained in fp32 shards (4 layers of a 1.1B's width, 0.33B parameters, in
shards of at most 300 MB), read by launcher/models/weights.py into each rank's own CUDA
storage under ddp (whole tensors), fsdp (row shards) and zero3 (flat partitions), one rank
each. Step 1's loss must be the saved model's own, computed here by transformers on CUDA (the
head is scaled up before saving so that the loss depends on the weights, not only on the
vocabulary size), and the start-up peak (summary.json's startup.device_peak_bytes) must not
pass the plan's start-up: a rank holds what it keeps, not the checkpoint. The runs come from
scripts/gpu_cases.py. Skipped without a CUDA GPU."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from gpu_runs import GPUS, finished, gib, plan_row, record, save_llama, together
from runs import REPO, read_metrics

sys.path.insert(0, str(REPO / "scripts"))
from gpu_cases import HF_MODELS, PRETRAINED, hf_runs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU")]
STARTUP_SLACK = 256 * 2**20
TITLE = "Pretrained weights into CUDA tensors (a 0.33B Llama in fp32 shards, one rank)"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    # logits of a few units (the head scaled up): the loss tells the weights apart
    folder = save_llama(
        tmp_path_factory.mktemp("llama_4l"), HF_MODELS["llama_4l"], torch.float32, head_scale=40, max_shard_size="300MB"
    )
    assert len(list(folder.glob("*.safetensors"))) > 1, "expected shards"
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, saved):
    todo = hf_runs(PRETRAINED, "llama_4l", str(saved))
    return todo, together(tmp_path_factory.mktemp("pretrained"), todo)


def own_loss(saved, run) -> float:
    """The saved model's loss on step 1's batch (the loop's samples 0..global_batch-1), on CUDA in fp32."""
    from transformers import AutoModelForCausalLM

    from launcher import config as C
    from launcher.data.read import build_dataset
    from launcher.models.gpt import lm_loss
    from launcher.parallel import degrees as D

    cfg = C.load_frozen(run)
    batch = build_dataset(cfg).__getitems__(list(range(D.global_batch(cfg, 1))))
    x, y = batch[:, :-1].cuda(), batch[:, 1:].cuda()
    torch.backends.cuda.matmul.allow_tf32 = cfg.precision.tf32  # as the run computed
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).cuda()
    with torch.no_grad():
        return lm_loss(model(input_ids=x).logits, y).item()


@pytest.mark.parametrize("name", list(PRETRAINED))
def test_each_rank_reads_its_part_into_cuda_and_gets_the_saved_models_loss(runs, saved, name):
    todo, done = runs
    run = finished(done, name)
    got = read_metrics(run)[0]["loss"]
    want = own_loss(saved, run)
    row = plan_row(todo[name], world=1)
    startup = json.loads((run / "summary.json").read_text())["startup"]["device_peak_bytes"][0]
    record(
        name,
        {
            "loss": got,
            "saved_model_loss": want,
            "planned_startup": row.startup,
            "measured_startup": startup,
            "table": {
                "title": TITLE,
                "columns": [
                    "run",
                    "step-1 loss",
                    "saved model's loss",
                    "start-up planned GiB",
                    "start-up measured GiB",
                ],
                "row": [name, f"{got:.5f}", f"{want:.5f}", gib(row.startup), gib(startup)],
            },
        },
    )
    assert got == pytest.approx(want, rel=5e-3), (name, got, want)  # TF32 in both; a wrong read is off by units
    assert startup <= max(1.10 * row.startup, row.startup + STARTUP_SLACK), (name, startup, row.startup)
