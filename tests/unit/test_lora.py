"""model.lora without ranks: the adapters on a meta model, their names in PEFT's files, the
planner's counts, the plan for an 8B fine-tune on one 24 GB GPU, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import TINY_LLAMA
from runs import assert_refused
from transformers import AutoModelForCausalLM, LlamaConfig  # imported before any test captures stderr

from launcher import models
from launcher.launch import cli
from launcher.launch.compose import compose_config
from launcher.models import lora
from launcher.planner import lora as planned


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-unit") / "llama"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    ).save_pretrained(folder)
    return folder


def test_adapters_start_as_the_base_and_alone_train(base):
    cfg, _, _ = compose_config(
        [
            "model=hf",
            f"model.pretrained={base}",
            "model.lora.rank=4",
            "precision=fp32",
            "model.lora.targets=[q_proj,v_proj,down_proj]",
        ]
    )
    model = models.build(cfg, torch.device("cpu"))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(lora.is_adapter(n) for n in trained)
    assert len(trained) == 2 * 3 * TINY_LLAMA["num_hidden_layers"]
    tokens = torch.randint(0, 300, (2, 12))
    plain = AutoModelForCausalLM.from_pretrained(base)(input_ids=tokens).logits
    assert torch.equal(model(tokens), plain)  # B starts at zero
    peft = lora.peft_state(model.state_dict())
    assert all(k.startswith("base_model.model.model.layers.") and ".lora_" in k for k in peft)


def test_the_planner_counts_the_adapters_the_model_has(base):
    """Counted from the shape (no model built), under the project decoder's names, for the
    Llama family's projection names."""
    from launcher.planner.plan import planned_model

    for targets in ("null", "[q_proj,k_proj,o_proj]", "[gate_proj,up_proj]"):
        cfg, _, _ = compose_config(
            ["model=hf", f"model.pretrained={base}", "model.lora.rank=8", f"model.lora.targets={targets}"]
        )
        built = sum(p.numel() for n, p in models.on_meta(cfg).named_parameters() if lora.is_adapter(n))
        counts = planned.counts(planned_model(cfg).model)
        assert counts.trainable == built, targets
        assert counts.frozen == sum(
            p.numel() for n, p in models.on_meta(cfg).named_parameters() if not lora.is_adapter(n)
        )


def test_an_8b_qlora_fits_one_24_gb_gpu_where_a_full_fine_tune_must_offload(capsys):
    """The issue's own example: Llama-3-8B, rank 16, nf4, seq 4096 on one 24 GB GPU."""
    args = ["model=llama3_8b", "cluster.gpus_per_node=1", "cluster.gpu_memory_gb=24", "train.seq_len=4096", "--json"]
    assert cli.main(["plan", "model.lora.rank=16", "model.lora.base_dtype=nf4", *args]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["layout"]["recipe"] for r in rows} == {"ddp"}  # nf4: the ddp engine alone
    best = next(r for r in rows if r["recommended"])
    gib = 2**30
    assert best["params"] < 6 * gib  # 7.0B projections at 0.52 bytes + embedding and head at 2
    assert best["optim"] < 0.4 * gib  # 42M adapters x 8
    assert cli.main(["plan", *args]) == 0
    full = [r for r in json.loads(capsys.readouterr().out)["rows"] if r["fits"]]
    assert all(r["layout"]["offload_optim"] for r in full)  # only with the states in host memory


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["model.lora.rank=-1"], ["model.lora.rank=-1", ">= 0"]),
        (
            ["model.lora.rank=8", "model.lora.targets=[q_proj,nope]"],
            ["model.lora.targets=nope", "q_proj, up_proj, v_proj"],
        ),
        (["model.lora.rank=8", "recipe=tp"], ["model.lora.rank=8", "recipe=tp", "ddp, fsdp and zero1-3"]),
        (["model.lora.rank=8", "recipe=fsdp", "model.lora.base_dtype=nf4"], ["base_dtype=nf4", "ddp engine"]),
        (["model.lora.rank=8", "model.lora.alpha=0"], ["model.lora.alpha=0", "> 0"]),
        (["model.lora.rank=8", "model.lora.dropout=1.0"], ["model.lora.dropout=1.0", "[0, 1)"]),
        (["model.lora.rank=8", "model.lora.base_dtype=bf16", "precision=fp32"], ["base_dtype=bf16", "precision=fp32"]),
    ],
)
def test_bad_lora_input_is_one_line(overrides, words, base, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["model=hf", f"model.pretrained={base}", *overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert_refused(code, out, err, words)
    assert not (tmp_path / "run").exists()


def test_adapters_over_a_random_start_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["model.lora.rank=8", f"hydra.run.dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert_refused(code, out, err, ["model.lora.rank=8", "pretrained base", "make plan takes any shape"])


def test_lora_and_low_bit_states_without_torchao_are_one_line(base, tmp_path, capsys, monkeypatch):
    """torchao is the fp8 extra, not the first run's install: asked for its NF4 base or its
    low-bit optimizers without it, the launcher says so (the ranks would fail to import it)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    for extra, words in (
        (["model.lora.base_dtype=nf4"], ["base_dtype=nf4", "fp8 extra"]),
        (["optim=adamw8bit"], ["optim.name=adamw8bit", "fp8 extra"]),
    ):
        code = cli.main(
            ["model=hf", f"model.pretrained={base}", "model.lora.rank=8", *extra, f"hydra.run.dir={tmp_path / 'run'}"]
        )
        out, err = capsys.readouterr()
        assert_refused(code, out, err, words)


def test_a_model_without_linears_in_its_layers_is_refused():
    """GPT-2's projections are Conv1D: adapters on nothing would freeze every weight."""
    from bad_inputs import HF

    from launcher.launch.checks.levers import validate_lora

    cfg, _, _ = compose_config(["model=hf", f"model.config={HF['gpt2']}", "model.lora.rank=8"])
    with pytest.raises(Exception, match="no nn.Linear inside its decoder layers"):
        validate_lora(cfg)
