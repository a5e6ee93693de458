"""model=hf: a transformers causal LM (a tiny Llama built here) under the recipes, its
exports, and the project's decoder exported as LlamaForCausalLM.

The slow runs train 4 steps in fp32 with the same data and global batch. Those that
start from the same saved model (model.pretrained) must give the saved model's own loss
at step 1, computed here in-process, and the same losses as each other at every step
(reduction order only); those that start from its config.json (model.config, random
init from train.seed) must agree with each other, which holds only if every rank built
the same weights. Runs are launched once, on first use, and shared by the tests.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hf_models import TINY_LLAMA, tiny_llama_config
from runs import launch, read_metrics
from shared import Run, SharedRuns

from launcher import config as C
from launcher import models
from launcher.data.read import build_dataset
from launcher.launch import cli
from launcher.models.gpt import lm_loss
from launcher.parallel import degrees as D

REL = 1e-4  # fp32: the order of reductions is all that differs between layouts


COMMON = [
    "model=hf",
    "train.steps=4",
    "optim.warmup_steps=1",
    "train.seq_len=32",
    "train.micro_batch=2",
    "train.global_batch=8",
    "precision=fp32",
    "logger=none",
    "logger.log_every=1",
    "checkpoint.every=2",
]


STEP2, STEP4 = "checkpoints/step_00000002", "checkpoints/step_00000004"


# Each run by name (tests/helpers/shared.py); extra["weights"]: where they come from, "config" (random
# init of the untied config) or "pretrained" (the saved folder)
CONFIG, PRETRAINED = {"weights": "config"}, {"weights": "pretrained"}
RUNS = {
    "ddp": Run(["recipe=ddp", "train.activation_checkpointing=full"], extra=CONFIG),
    "fsdp": Run(["recipe=fsdp"], extra=CONFIG),
    "tp": Run(["recipe=tp", "train.activation_checkpointing=selective"], extra=PRETRAINED),
    "pp": Run(["recipe=pp", "parallel.pp_schedule=1f1b"], extra=PRETRAINED),
    "zero3": Run(["recipe=zero3"], extra=PRETRAINED),
    # step 1 only: the same pretrained folder under the other recipes, and random init of its config
    "ddp_pretrained": Run(["recipe=ddp", "train.stop_at=1", "checkpoint.every=0"], extra=PRETRAINED),
    "tp_fsdp_pretrained": Run(
        ["recipe=tp_fsdp", "cluster.nproc_per_node=4", "train.stop_at=1", "checkpoint.every=0"], extra=PRETRAINED
    ),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Llama made with transformers and saved as a user's local checkpoint; its
    head is tied to the embedding (the config-only runs' is not)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    fields = {**TINY_LLAMA, "tie_word_embeddings": True}
    del fields["model_type"]
    model = AutoModelForCausalLM.from_config(LlamaConfig(**fields))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(folder)
    assert list(folder.glob("*.safetensors")) and (folder / "config.json").is_file()
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, saved) -> SharedRuns:
    root = tmp_path_factory.mktemp("hf_runs")
    weights = {
        "config": f"model.config={tiny_llama_config(root / 'untied')}",
        "pretrained": f"model.pretrained={saved}",
    }
    defined = {
        n: dataclasses.replace(r, overrides=[weights[r.extra["weights"]], *r.overrides]) for n, r in RUNS.items()
    }
    return SharedRuns(root, defined, common=COMMON)


def losses(run: Path) -> list[float]:
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4][: len(rows)] and rows, rows
    return [r["loss"] for r in rows]


def first_batch(run: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1's global batch, as the loop reads it (samples 0..global_batch-1)."""
    cfg = C.load_frozen(run)
    batch = build_dataset(cfg).__getitems__(list(range(D.global_batch(cfg, 2))))
    return batch[:, :-1], batch[:, 1:]


def trained(run: Path, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The run's model with the given full weights (the launcher's own wrapper)."""
    cfg = C.load_frozen(run)
    model = models.build(cfg, torch.device("cpu"))
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.slow
def test_pretrained_weights_give_the_saved_models_own_loss_under_every_recipe(runs, saved):
    from transformers import AutoModelForCausalLM

    x, y = first_batch(runs("tp"))
    own = AutoModelForCausalLM.from_pretrained(saved)
    with torch.no_grad():
        want = lm_loss(own(input_ids=x).logits, y).item()
    tp, pp, zero3 = losses(runs("tp")), losses(runs("pp")), losses(runs("zero3"))
    for name, got in (("tp", tp), ("pp", pp), ("zero3", zero3)):
        assert got[0] == pytest.approx(want, rel=1e-5), (name, got[0], want)
    # Each rank read only the slices it owns (weights.py): ddp whole tensors, tp_fsdp 2-D
    # shards (fsdp's row shards of tensor-parallel slices), zero3 flat partitions; all give
    # the saved model's loss.
    for name in ("ddp_pretrained", "tp_fsdp_pretrained"):
        got = losses(runs(name))
        assert len(got) == 1 and got[0] == pytest.approx(want, rel=1e-5), (name, got, want)
    # The same config drawn from train.seed instead (the values every rank draws, at any
    # layout: launcher/models/init.py) is another model.
    cfg = C.load_frozen(runs("ddp_pretrained"))
    drawn = models.build(
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=None, config=str(saved))),
        torch.device("cpu"),
    )
    with torch.no_grad():
        random = lm_loss(drawn(x), y).item()
    assert abs(random - want) > 1e-2, (random, want)
    assert tp == pytest.approx(pp, rel=REL) and tp == pytest.approx(zero3, rel=REL)  # and they train alike
    assert tp[-1] < tp[0]
    print(f"step-1 loss: saved model {want:.6f}, tp {tp[0]:.6f}, pp {pp[0]:.6f}, zero3 {zero3[0]:.6f}")


@pytest.mark.slow
def test_random_init_is_the_same_on_every_rank_ddp_and_fsdp_agree(runs):
    """fsdp shards what each rank built itself (ddp would broadcast rank 0's weights): equal
    losses mean every rank drew the same initial weights from train.seed."""
    ddp, fsdp = losses(runs("ddp")), losses(runs("fsdp"))
    assert ddp == pytest.approx(fsdp, rel=REL)
    assert ddp[-1] < ddp[0]
    rows = read_metrics(runs("ddp"))
    assert "mfu" not in rows[0] and rows[0]["mem/model_state_bytes"] > 0  # no MFU without a known peak (a CPU)
    summary = json.loads((runs("fsdp") / "summary.json").read_text())
    assert summary["world_size"] == 2


@pytest.mark.slow
def test_resume_from_step_2_is_bit_identical(runs, tmp_path):
    straight = runs("ddp")
    overrides = RUNS["ddp"].overrides
    cfg = C.load_frozen(straight)
    resumed = tmp_path / "resumed"
    proc = launch(
        *COMMON,
        f"model.config={cfg.model.config}",
        *overrides,
        f"checkpoint.resume={straight / STEP2}",
        run_dir=resumed,
    )
    assert "resumed from" in proc.stdout
    got = read_metrics(resumed)
    want = read_metrics(straight)
    assert [r["step"] for r in got] == [3, 4]
    assert [r["loss"] for r in got] == [r["loss"] for r in want[2:]]  # exact
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want[2:]]
    wa = torch.load(straight / STEP4 / "engine/model.pt", weights_only=True)
    wb = torch.load(resumed / STEP4 / "engine/model.pt", weights_only=True)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert {"model.layers.0.self_attn.q_proj.weight", "lm_head.weight"} <= set(wa)  # transformers' own names


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "pp", "zero3"])
def test_export_hf_loads_with_from_pretrained_and_gives_the_trained_logits(runs, name, tmp_path, capsys):
    """ddp's whole-model file (untied), pp's stage-wise DCP shards (tied: the head copy on
    the last stage) and ZeRO-3's partitions: the export is a folder that from_pretrained
    loads, with the trained weights (read for pp by torch's own DCP converter, for zero3
    by DeepSpeed's zero_to_fp32)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    run = runs(name)
    assert cli.main(["export", str(run)]) == 2  # the project's single-file format is for its own decoder
    assert "export.format=safetensors: model=hf exports as export.format=hf" in capsys.readouterr().err
    assert cli.main(["export", str(run), "export.format=hf", f"export.out={tmp_path / 'hf'}"]) == 0
    assert str(tmp_path / "hf") in capsys.readouterr().out
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= files, files
    if name == "ddp":
        state = torch.load(run / STEP4 / "engine/model.pt", weights_only=True)
    elif name == "zero3":
        from engines.zero.engine import consolidate

        state = consolidate(C.load_frozen(run), run / STEP4 / "engine")
    else:
        dcp_to_torch_save(run / STEP4 / "engine", tmp_path / "pp.pt")
        state = torch.load(tmp_path / "pp.pt", weights_only=True)["model"]
        assert "lm_head.weight" not in state  # stored once, under the embedding's name
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    reference = trained(run, state)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert loaded.config.tie_word_embeddings == (name != "ddp")  # pp and zero3 trained the saved, tied model
    x = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 32))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, reference(x))
    # bf16 exports halve the file and say so in the config
    assert (
        cli.main(["export", str(run), "export.format=hf", "export.dtype=bf16", f"export.out={tmp_path / 'bf16'}"]) == 0
    )
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
