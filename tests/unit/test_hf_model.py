"""model=hf without a training run: the model's own activation-checkpointing switch, its layout,
FLOPs and shape from the HF config, the space check, the project's decoder exported as
LlamaForCausalLM, and make plan with model=hf. The runs under every recipe:
tests/e2e/test_hf_model_runs.py."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import tiny_llama_config

from launcher import config as C
from launcher import models
from launcher.launch import cli
from launcher.launch.rundir import prepare as rundir
from launcher.models.gpt import GPT


# ----------------------------------------------------------------------------- in-process
def saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward in one forward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x).backward()
    return total


def test_activation_checkpointing_is_the_models_own_switch(tmp_path):
    """full: every decoder layer recomputes (transformers' gradient checkpointing);
    selective: every ac_every-th; each keeps less for backward than the one before."""
    config = tiny_llama_config(tmp_path)
    x = torch.randint(0, 300, (2, 64))
    held = {}
    for mode in ("none", "selective", "full"):
        cfg = compose(
            "model=hf", f"model.config={config}", f"train.activation_checkpointing={mode}", "train.ac_every=2"
        )
        torch.manual_seed(0)
        model = models.build(cfg, torch.device("cpu"))
        models.set_activation_checkpointing(model, cfg)
        flags = [layer.gradient_checkpointing for layer in models.decoder_layers(model)]
        assert flags == {"none": [False] * 4, "selective": [True, False, True, False], "full": [True] * 4}[mode]
        held[mode] = saved_bytes(model, x)
    assert held["none"] > held["selective"] > held["full"], held


def compose(*overrides: str) -> C.Config:
    cfg, _, _ = cli.compose_config(list(overrides))
    return cfg


def test_layout_flops_and_shape_come_from_the_hf_config(tmp_path):
    from launcher.config import num_params
    from launcher.models import hf
    from launcher.models.gpt import flops_per_token

    cfg = compose("model=hf", f"model.config={tiny_llama_config(tmp_path)}")
    lay = models.layout(cfg)
    assert (lay.embed, lay.layers, lay.norm, lay.head, lay.tied) == (
        "model.embed_tokens",
        "model.layers",
        "model.norm",
        "lm_head",
        False,
    )
    assert set(lay.colwise) == {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    }
    assert set(lay.rowwise) == {"self_attn.o_proj", "mlp.down_proj"}
    assert set(lay.norms) == {"input_layernorm", "post_attention_layernorm"}
    shape = hf.gpt_shape(cfg.model)
    model = models.on_meta(cfg)
    # The project decoder of the same shape is the same size: the planner's formulas hold.
    assert num_params(shape) == model.num_params() == GPT(shape).num_params()
    h, f, v, L, kv = 64, 128, 300, 4, 2 * 16
    matmul = L * (2 * h * h + 2 * h * kv + 3 * h * f) + h * v
    assert models.flops_per_token(cfg, 32) == 6 * matmul + 12 * L * h * 32 == flops_per_token(shape, 32)
    assert models.model_vocab_size(cfg) == hf.model_vocab_size(cfg) == 300


def test_the_space_check_counts_the_hf_model_itself(tmp_path):
    """16 bytes for each parameter of the model as built: for model=hf the Hugging Face
    model's own count (it once counted the project's default decoder instead)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from launcher.planner.memory import ParamCounts

    cfg = compose("model=hf", f"model.config={tiny_llama_config(tmp_path, num_hidden_layers=6)}")
    want = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).num_parameters()
    assert rundir.checkpoint_bound(cfg) == 16 * want
    assert ParamCounts.of(cfg.model).total != want  # the count before


@pytest.mark.parametrize("tied,kv_heads", [(True, None), (False, 2)])
def test_the_projects_decoder_exports_as_llama_with_the_same_logits(tied, kv_heads, tmp_path):
    from transformers import AutoModelForCausalLM

    from launcher.models.hf_export import save_pretrained

    cfg = compose(f"model.tie_embeddings={str(tied).lower()}", f"model.n_kv_heads={kv_heads or 'null'}")
    torch.manual_seed(0)
    gpt = GPT(cfg.model).eval()
    state = {k: v.detach().clone() for k, v in gpt.state_dict().items()}
    save_pretrained(cfg, state, tmp_path, torch.float32)
    llama = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert llama.config.tie_word_embeddings == tied
    x = torch.randint(0, cfg.model.vocab_size, (2, 64))
    with torch.no_grad():
        want, got = gpt(x), llama(input_ids=x).logits
    # Same arithmetic up to the order of the rotary channels inside each head's dot product.
    assert torch.allclose(got, want, rtol=0, atol=2e-5), (got - want).abs().max()
    print(f"tied={tied}: max |logit difference| = {(got - want).abs().max():.2e}")


def test_plan_with_model_hf(tmp_path, capsys):
    llama = tiny_llama_config(tmp_path / "llama")
    assert (
        cli.main(["plan", "model=hf", f"model.config={llama}", "cluster.gpu_memory_gb=80", "cluster.gpus_per_node=8"])
        == 0
    )
    out = capsys.readouterr().out
    assert "recommended: make train" in out
    gpt2 = tmp_path / "gpt2" / "config.json"
    gpt2.parent.mkdir()
    gpt2.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_embd": 64,
                "n_layer": 2,
                "n_head": 4,
                "vocab_size": 300,
                "n_positions": 256,
                "bos_token_id": 0,
                "eos_token_id": 0,
            }
        )
    )
    assert (
        cli.main(["plan", "model=hf", f"model.config={gpt2}", "cluster.gpu_memory_gb=80", "cluster.gpus_per_node=8"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a Llama-layout decoder" in err[0] and "do not apply" in err[0], err
