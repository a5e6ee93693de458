"""A Hugging Face Mixtral folder trained by the project's MoE decoder (model=moe_tiny's shape,
model.pretrained=DIR): fsdp on 2 gloo ranks, each reading only its shards of the stacked
experts, starts from the folder's own loss; `launcher export` writes a folder from_pretrained
loads with the trained model's logits. One short run, shared by the tests.

The run balances with model.moe.balance=none: the auxiliary loss (a training choice, not part of
the checkpoint) would be added to the logged loss, which is compared with transformers' plain
next-token loss of the folder's model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import mixtral_args, tiny_mixtral
from runs import here, launch, read_metrics

from launcher import config as C
from launcher.data.read import build_dataset
from launcher.launch.commands.export import load_exported
from launcher.models.gpt import lm_loss

ARGS = [
    "recipe=fsdp",
    "cluster.nproc_per_node=2",
    "train.steps=2",
    "optim.warmup_steps=1",
    "train.seq_len=32",
    "train.micro_batch=2",
    "train.global_batch=8",
    "precision=fp32",
    "logger=none",
    "logger.log_every=1",
    "checkpoint.every=2",
    "model.moe.balance=none",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path, torch.nn.Module]:
    """(the run, the folder it started from, the transformers model saved there)."""
    root = tmp_path_factory.mktemp("moe_hf")
    saved = tiny_mixtral(root / "mixtral")
    launch(*mixtral_args(root / "mixtral"), *ARGS, run_dir=root / "run")
    return root / "run", root / "mixtral", saved


@pytest.mark.slow
def test_fsdp_ranks_reading_their_shards_start_from_the_folders_own_loss(run):
    folder_run, _, saved = run
    cfg = C.load_frozen(folder_run)
    batch = build_dataset(cfg).__getitems__(list(range(8)))  # step 1's global batch
    with torch.no_grad():
        want = lm_loss(saved(input_ids=batch[:, :-1]).logits, batch[:, 1:]).item()
    rows = read_metrics(folder_run)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == pytest.approx(want, rel=1e-5), (rows[0]["loss"], want)
    assert "moe/load_max_over_mean/0" in rows[0]
    print(f"step-1 loss: transformers {want:.6f}, fsdp on 2 ranks {rows[0]['loss']:.6f}")


@pytest.mark.slow
def test_the_export_loads_with_from_pretrained_and_gives_the_trained_logits(run, tmp_path):
    from transformers import AutoModelForCausalLM

    folder_run, _, saved = run
    here("export", str(folder_run), "export.format=hf", f"export.out={tmp_path / 'hf'}")
    here("export", str(folder_run), f"export.out={tmp_path / 'own'}")
    trained = load_exported(tmp_path / "own" / "model.safetensors").eval()  # the project's decoder, trained weights
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, before = trained(x), loaded(input_ids=x).logits, saved(input_ids=x).logits
    diff = (got - want).abs().max().item()
    assert diff < 2e-5, diff
    assert (before - want).abs().max().item() > 100 * diff  # two steps changed the model: the export holds them
    print(f"export: from_pretrained's max |logit difference| to the trained decoder = {diff:.2e}")
