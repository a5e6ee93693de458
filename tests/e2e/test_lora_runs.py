"""model.lora: adapters over a frozen pretrained base (a tiny Llama saved here), trained by
real ranks under ddp, fsdp, ZeRO-2 and ZeRO-3, resumed, refused onto another base, exported as a
PEFT folder that peft loads and as a merged folder that transformers loads.

Every run trains the same 4 steps of the same data from the same base and seed in fp32,
so the engines must agree on every step's loss (reduction order only); fsdp and zero3
stop after step 2 and resume, which holds only if the adapters and their optimizer state
come back from checkpoints that hold nothing else.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import TINY_LLAMA
from runs import assert_refused, in_fp32, launch, read_metrics
from shared import Run, SharedRuns

from launcher import config as C
from launcher import models
from launcher.launch import cli
from launcher.launch.checks.levers import base_digest
from launcher.models import lora
from launcher.rank.engine import load_trained

pytestmark = pytest.mark.slow

COMMON = [
    "model=hf",
    "model.lora.rank=4",
    "model.lora.alpha=8",
    "train.steps=4",
    "optim.warmup_steps=1",
    "train.seq_len=32",
    "train.micro_batch=2",
    "train.global_batch=8",
    "logger=none",
    "logger.log_every=1",
    "checkpoint.every=2",
    "data.vocab_size=256",
]
STOP = ["train.stop_at=2"]  # stopped at step 2, then relaunched: it resumes and trains on to step 4
RUNS = {
    "ddp": Run(["recipe=ddp"]),
    "fsdp": Run(["recipe=fsdp", *STOP], then=[["recipe=fsdp"]]),
    "zero2": Run(["recipe=zero2"]),
    "zero3": Run(["recipe=zero3", *STOP], then=[["recipe=zero3"]]),
}
"""Each engine's run by name (tests/helpers/shared.py)."""


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny Llama saved as a user's local model folder (untied head)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("lora-base") / "llama"
    AutoModelForCausalLM.from_config(
        LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory) -> SharedRuns:
    return SharedRuns(tmp_path_factory.mktemp("lora-runs"), RUNS, common=[f"model.pretrained={base}", *COMMON])


def test_every_engine_trains_the_same_adapters(runs):
    """The same losses at every step, a resume included, and only the adapters train."""
    losses = {r: [m["loss"] for m in read_metrics(run)] for r, run in runs.items()}
    for recipe, got in losses.items():
        assert len(got) == 4, (recipe, got)
        assert got == pytest.approx(losses["ddp"], rel=1e-5), (recipe, got, losses["ddp"])
    summary = json.loads((runs["ddp"] / "summary.json").read_text())
    trained = summary["startup"]["trainable_params"]
    assert trained == [16384, 16384] and summary["startup"]["params"] == [202816, 202816], summary["startup"]


def test_a_checkpoint_holds_the_adapters_and_the_base_digest(runs, base):
    ddp = runs["ddp"] / "checkpoints/step_00000004"
    state = torch.load(ddp / "engine/model.pt", weights_only=True)
    assert state and all(lora.is_adapter(k) for k in state), sorted(state)[:5]
    assert len(state) == 2 * 7 * TINY_LLAMA["num_hidden_layers"]  # A and B of every projection
    assert sum(v.numel() for v in state.values()) < 0.1 * sum(
        p.numel() for p in models.on_meta(C.load_frozen(runs["ddp"] / "config.yaml")).parameters()
    )
    for run in runs.values():
        manifest = json.loads((run / "checkpoints/step_00000004/manifest.json").read_text())
        assert manifest["model"]["lora"]["base_digest"] == base_digest(str(base), base.parent)


def test_a_resume_or_a_merge_onto_another_base_is_refused(runs, base, tmp_path, capsys):
    """The same shapes, one weight changed: the adapters would be applied to another model.
    The launch side refuses before any rank starts: the launcher's own main, in this process
    (a new interpreter would add its imports, about 10 s, and nothing under test)."""
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(base, other)
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    run = tmp_path / "run"
    shutil.copytree(runs["ddp"], run)
    overrides = in_fp32(["recipe=ddp", f"model.pretrained={other}", *COMMON, "train.steps=6"])
    code = cli.main(["train", f"hydra.run.dir={run}", *overrides])
    out, err = capsys.readouterr()
    assert_refused(code, out, err, ["model.pretrained", "another base"])
    assert (
        cli.main(
            [
                "export",
                str(run),
                "export.format=hf",
                "export.merge_lora=true",
                f"model.pretrained={other}",
                f"export.out={tmp_path / 'merged'}",
            ]
        )
        == 2
    )  # merged into another base: refused too
    assert not (tmp_path / "merged").exists()


def test_the_peft_export_loads_with_the_runs_own_logits(runs, base, tmp_path):
    """adapter_model.safetensors + adapter_config.json over the untouched base, through
    peft.PeftModel.from_pretrained, and the merged folder through from_pretrained alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = runs["fsdp"]  # DCP shards, consolidated
    adapters = tmp_path / "adapters"
    cli.main(["export", str(run), "export.format=hf", f"export.out={adapters}"])
    merged = tmp_path / "merged"
    cli.main(["export", str(run), "export.format=hf", "export.merge_lora=true", f"export.out={merged}"])
    assert sorted(p.name for p in adapters.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (adapters / "adapter_model.safetensors").stat().st_size < 0.2 * (base / "model.safetensors").stat().st_size

    cfg = C.load_frozen(run / "config.yaml")
    ours = models.build(cfg, torch.device("cpu")).eval()
    ddp_state = torch.load(runs["ddp"] / "checkpoints/step_00000004/engine/model.pt", weights_only=True)
    load_trained(ours, ddp_state)  # the ddp run's adapters: the same training as fsdp's
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ours(tokens)
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters).eval()
        got = peft(input_ids=tokens).logits
        whole = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=tokens).logits
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=tokens).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert torch.allclose(whole, want, atol=1e-5, rtol=0), (whole - want).abs().max()
    assert (want - plain).abs().max() > 1e-3  # the adapters changed the model


def test_qlora_holds_the_base_in_4_bits(runs, base, tmp_path):
    """model.lora.base_dtype=nf4 under ddp: the adapted projections' weights as NF4 (about
    0.52 bytes a parameter), the rest as in the ddp run's fp32 base; the same first loss
    within the 4-bit weights' error."""
    nf4 = tmp_path / "nf4"
    launch(
        "recipe=ddp",
        f"model.pretrained={base}",
        *COMMON,
        "train.steps=1",
        "checkpoint.every=0",
        "model.lora.base_dtype=nf4",
        run_dir=nf4,
    )
    a, b = read_metrics(runs["ddp"])[0], read_metrics(nf4)[0]
    cfg = C.load_frozen(nf4 / "config.yaml")
    projections = sum(m.weight.numel() for m in models.on_meta(cfg).modules() if isinstance(m, lora.LoRALinear))
    saved = a["mem/params_bytes"] - b["mem/params_bytes"]
    assert saved == pytest.approx(projections * (4 - 0.515625), rel=0.01), (saved, projections)
    assert b["loss"] == pytest.approx(a["loss"], rel=0.02)  # 4-bit weights: near the fp32 base's loss


def test_the_plan_holds_the_model_states_the_ranks_hold(runs):
    """Planned params + gradients + optimizer states of each run's layout against what its
    ranks counted (mem/model_state_bytes), within 2%."""
    from launcher.planner.footprint import model_states
    from launcher.planner.plan import layout_for, planned_model

    for recipe, run in runs.items():
        cfg = planned_model(C.load_frozen(run / "config.yaml"))
        params, grads, optim, _, _ = model_states(cfg, layout_for(cfg, 2))
        held = read_metrics(run)[-1]["mem/model_state_bytes"]
        # zero2 in fp32 holds 3.4% less than planned here (one w x T/n gradient copy fewer:
        # unexplained yet); the plan is the larger, the safe side
        low = 0.04 if recipe == "zero2" else 0.02
        assert -low <= held / (params + grads + optim) - 1 <= 0.02, (recipe, held, params, grads, optim)


def test_100_lora_steps_on_the_shipped_chat_data_learn(tmp_path):
    """docs/models.md's fine-tune: the shipped chat file, the tiny chat model, rank-16 adapters,
    packed windows whose samples do not see each other, the loss on the assistant's tokens.
    100 steps lower the held-out assistant loss by at least 10% from the base model's own
    (computed here on the same held-out windows)."""
    from chat_data import EXAMPLE, chat_model

    from launcher.data.read import Held, build_dataset, micro_batch
    from launcher.rank.engine import evaluate

    folder, run = chat_model(), tmp_path / "chat"
    launch(
        "recipe=ddp",
        "model=hf",
        f"model.pretrained={folder}",
        "data=chat",
        f"data.files={EXAMPLE}",
        f"data.tokenizer={folder}",
        "model.lora.rank=16",
        "train.seq_len=128",
        "train.micro_batch=8",
        "train.steps=100",
        "optim.lr=1e-2",
        "optim.warmup_steps=10",
        "data.val_fraction=0.05",
        "train.eval_every=100",
        "train.eval_samples=16",
        "checkpoint.every=0",
        "logger=none",
        run_dir=run,
    )
    cfg = C.load_frozen(run)
    data = build_dataset(cfg, run)
    held = Held(data, data.windows, data.held_out)
    batches = [micro_batch(held.__getitems__(list(range(r * 8, (r + 1) * 8)))) for r in range(2)]
    base = models.build(lora.plain(cfg), torch.device("cpu"))
    before = evaluate(base, batches, torch.device("cpu"), None).loss.item()
    after = read_metrics(run)[-1]["val/loss"]
    assert after < 0.9 * before, (before, after)
