"""A Hugging Face Mixtral folder read into the project's MoE decoder and written back
(launcher/models/hf_adapter.py, hf_sources.py), in-process: transformers' logits from both
layouts a folder may hold, every box and flat range read alone equal to that part of the
whole, the export that from_pretrained loads, and the folders refused. The runs:
tests/e2e/test_hf_moe_runs.py."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from hf_models import mixtral_args, tiny_mixtral
from parts import check_parts_read_alone

from launcher import models
from launcher.config import ConfigError
from launcher.launch import cli
from launcher.models import hf_adapter
from launcher.models.hf_sources import flat_boxes

CPU = torch.device("cpu")


def compose(*overrides: str):
    cfg, _, _ = cli.compose_config(["precision=fp32", *overrides])
    return cfg


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, the transformers model saved there): Mixtral's per-expert files, in shards."""
    folder = tmp_path_factory.mktemp("mixtral")
    return folder, tiny_mixtral(folder)


@pytest.fixture(scope="module")
def fused(tmp_path_factory, saved):
    """The same weights in bf16 (as real checkpoints are) under transformers' own fused names
    (mlp.experts.gate_up_proj), one file."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("fused")
    shutil.copy(saved[0] / "config.json", folder)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in saved[1].state_dict().items()},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    return folder


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))


def routed(gpt, x) -> set[int]:
    """The experts block 0's router picked for x."""
    seen: list[torch.Tensor] = []
    hook = gpt.layers[0].feed_forward.router.register_forward_hook(lambda m, i, out: seen.append(out[0]))
    with torch.no_grad():
        gpt(x)
    hook.remove()
    return set(seen[0].flatten().tolist())


@pytest.mark.parametrize("layout", ["per_expert_shards", "fused"])
def test_a_mixtral_folder_gives_transformers_logits(saved, fused, layout):
    folder = saved[0] if layout == "per_expert_shards" else fused
    if layout == "per_expert_shards":
        assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    cfg = compose(*mixtral_args(folder))
    hf_adapter.check(cfg)
    gpt = models.build(cfg, CPU).eval()
    if layout == "fused":  # transformers reads the bf16 folder into fp32 as the launcher does
        from transformers import AutoModelForCausalLM

        own = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert gpt.layers[0].feed_forward.experts.w1.dtype == torch.float32
    else:
        own = saved[1]
    x = tokens()
    with torch.no_grad():
        got, want = gpt(x), own(input_ids=x).logits
    diff = (got - want).abs().max().item()
    assert diff < 2e-5, diff
    assert len(routed(gpt, x)) >= 6  # the tokens spread over the experts: routing is part of what matched
    print(f"{layout}: max |logit difference| = {diff:.2e} (logits up to {want.abs().max():.2f})")


def test_each_part_read_alone_is_that_part_of_the_whole(saved):
    """Boxes (FSDP and expert-parallel shards) and flat ranges (ZeRO-3 partitions) of every
    parameter, read alone, equal that part of the parameter read whole."""
    cfg = compose(*mixtral_args(saved[0]))
    whole = dict(models.build(cfg, CPU).named_parameters())
    check_parts_read_alone(hf_adapter.reader(cfg.model), whole, tries=3)


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (4, 3, 5), (2, 3, 2, 3)])
def test_flat_boxes_tile_the_range_in_order(shape):
    n = math.prod(shape)
    values = torch.arange(n).view(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            pieces = [
                (values[tuple(slice(a, b) for a, b in box)].reshape(-1), at)
                for box, at in flat_boxes(shape, start, stop)
            ]
            assert len(pieces) <= max(1, 2 * len(shape) - 1)
            assert [at for _, at in pieces] == [start + sum(len(p) for p, _ in pieces[:k]) for k in range(len(pieces))]
            got = torch.cat([p for p, _ in pieces]) if pieces else torch.empty(0, dtype=values.dtype)
            assert torch.equal(got, torch.arange(start, stop)), (shape, start, stop)


def test_the_export_is_mixtral_files_from_pretrained_loads_and_the_launcher_reads_back(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    from launcher.models.hf_export import save_pretrained

    cfg = compose(*mixtral_args(saved[0]))
    gpt = models.build(cfg, CPU).eval()
    with torch.no_grad():  # weights the folder does not hold: what a run would have trained
        for p in gpt.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    state = {k: v.detach().clone() for k, v in gpt.state_dict().items()}
    out = save_pretrained(cfg, state, tmp_path / "hf", torch.float32)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names  # the files' layout, as Mixtral's own
    assert not any("gate_up_proj" in n for n in names)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = tokens()
    with torch.no_grad():
        want, got = gpt(x), loaded(input_ids=x).logits
    diff = (got - want).abs().max().item()
    assert diff < 2e-5, diff
    back = models.build(compose(*mixtral_args(out)), CPU)  # and the launcher reads its own export back
    assert all(torch.equal(back.state_dict()[k], v) for k, v in state.items())
    print(f"export: from_pretrained's max |logit difference| = {diff:.2e}")


@pytest.mark.parametrize(
    "override,words",
    [
        ("model.moe.experts=4", ["model.moe.experts=4", "num_local_experts=8"]),
        ("model.moe.top_k=3", ["model.moe.top_k=3", "num_experts_per_tok=2"]),
        ("model.n_kv_heads=4", ["model.n_kv_heads=4", "num_key_value_heads=2"]),
        ("model.moe.expert_dim=64", ["model.moe.expert_dim=64", "intermediate_size=128"]),
        ("model.rope_theta=500000", ["model.rope_theta=500000.0", "rope_theta=10000.0"]),
        ("model.moe.shared_experts=1", ["model.moe.shared_experts=1", "shared_experts=0"]),
        ("model.moe.score=sigmoid", ["model.moe.score=sigmoid", "score=softmax"]),
    ],
)
def test_another_shape_is_refused_naming_both_values(saved, override, words):
    with pytest.raises(ConfigError) as e:
        hf_adapter.check(compose(*mixtral_args(saved[0]), override))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_missing_or_extra_tensors_are_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    state = {}
    for f in saved[0].glob("*.safetensors"):
        state |= load_file(f)
    for name, changed, words in [
        (
            "missing",
            {k: v for k, v in state.items() if k != "model.layers.1.block_sparse_moe.experts.3.w2.weight"},
            ["model.layers.1.block_sparse_moe.experts.3.w2.weight: missing from"],
        ),
        (
            "extra",
            {**state, "model.layers.0.block_sparse_moe.experts.8.w1.weight": torch.zeros(128, 128)},
            ["experts.8.w1.weight", "not a parameter of the model"],
        ),
        (
            "shape",
            {**state, "model.layers.0.block_sparse_moe.experts.5.w1.weight": torch.zeros(64, 128)},
            ["experts.0.w1.weight", "(8, -1)", "(8, 128, 128)"],
        ),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(saved[0] / "config.json", folder)
        save_file(changed, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ConfigError) as e:
            hf_adapter.check(compose(*mixtral_args(folder)))
        assert all(w in str(e.value) for w in words), (name, str(e.value))


def test_a_dense_llama_folder_reads_into_the_dense_decoder(tmp_path):
    from hf_models import TINY_LLAMA
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    own = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}))
    own.eval().save_pretrained(tmp_path)
    cfg = compose(
        "model.vocab_size=300",
        "model.dim=64",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.ffn_dim=128",
        "model.max_seq_len=256",
        "model.tie_embeddings=false",
        f"model.pretrained={tmp_path}",
    )
    hf_adapter.check(cfg)
    gpt = models.build(cfg, CPU).eval()
    x = tokens()
    with torch.no_grad():
        diff = (gpt(x) - own(input_ids=x).logits).abs().max().item()
    assert diff < 2e-5, diff


def test_model_hf_says_why_it_does_not_read_an_moe_folder(saved):
    from launcher.models import hf

    with pytest.raises(ConfigError) as e:
        hf.check_weights(compose("model=hf", f"model.pretrained={saved[0]}").model)
    assert "model_type 'mixtral'" in str(e.value) and "conversion mapping" in str(e.value), str(e.value)
    assert "model=mixtral_8x7b" in str(e.value)


def test_an_moe_mixtral_cannot_hold_is_not_exported_as_one(saved, tmp_path):
    from launcher.models.hf_export import save_pretrained

    cfg = compose("model=moe_tiny", "model.moe.shared_experts=1")
    state = models.build(cfg, CPU).state_dict()
    with pytest.raises(ConfigError, match="shared experts without moe.shared_gate, which mixtral's layout"):
        save_pretrained(cfg, state, tmp_path / "hf", torch.float32)
    assert not (tmp_path / "hf").exists()
