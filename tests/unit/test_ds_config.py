"""DeepSpeed's JSON from the Hydra config: golden files for the pure generator, the merge of
recipe.zero.extra, and DeepSpeed's own parser on the result (no ranks started).

Regenerate the golden files after an intended change with `UPDATE_GOLDEN=1 make test-quick`.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from golden import check_golden

from launcher import config as C
from launcher.host import deepspeed_env
from launcher.launch import cli
from launcher.parallel import ds_config as D

deepspeed_env()

ZERO_RECIPES = ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]

GOLDEN = {
    "ds_zero1.json": (["recipe=zero1"], 2, False),
    "ds_zero3_offload_accum.json": (
        [
            "recipe=zero3_offload",
            "model=gpt_small",
            "train.global_batch=64",
            "train.micro_batch=4",
            "optim.grad_clip=0.5",
            "precision=fp32",
        ],
        4,
        False,
    ),
    "ds_zero2_fp16_cuda.json": (
        [
            "recipe=zero2",
            "precision=fp16",
            "precision.initial_scale=1024",
            "train.activation_checkpointing=selective",
            "recipe.zero.reduce_bucket_size=200000000",
        ],
        8,
        True,
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_generated_config_is_golden(name):
    overrides, world, cuda = GOLDEN[name]
    cfg, _, _ = cli.compose_config(overrides)
    check_golden(name, D.text(D.deepspeed_config(cfg, world, cuda)))


def test_generated_values_come_from_the_hydra_config():
    cfg, _, _ = cli.compose_config(
        [
            "recipe=zero3",
            "model=gpt_small",
            "train.global_batch=48",
            "train.micro_batch=4",
            "optim.lr=2e-4",
            "optim.beta2=0.99",
            "optim.weight_decay=0.05",
            "precision=fp32",
        ]
    )
    ds = D.deepspeed_config(cfg, 3, cuda=False)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        48,
        4,
        4,
    )
    assert ds["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-4, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.05, "torch_adam": True},
    }
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["overlap_comm"] is True
    # Buckets follow the model (dim 384) unless set; persistence keeps the norms (384 elements) whole.
    assert z["reduce_bucket_size"] == 384 * 384 and z["stage3_param_persistence_threshold"] == 3840
    assert "scheduler" not in ds  # the schedule is launcher.config.lr_factor, handed over as a client scheduler


@pytest.mark.parametrize(
    "recipe,precision,world", list(itertools.product(ZERO_RECIPES, ["bf16", "fp32", "fp16"], [1, 2, 8]))
)
def test_deepspeed_parses_every_generated_config_and_reads_every_key(recipe, precision, world):
    """DeepSpeed's parser accepts what we generate, and reads every key we write (a key it
    ignored would be a setting that silently does nothing)."""
    cfg, _, _ = cli.compose_config(
        [
            f"recipe={recipe}",
            f"precision={precision}",
            "train.global_batch=64",
            "train.micro_batch=2",
            "train.activation_checkpointing=full",
        ]
    )
    ds = D.deepspeed_config(cfg, world, cuda=precision == "fp16")
    D.check(ds, ds, world)  # everything generated, checked as if a user had written it


def test_extra_keys_merge_and_conflicts_are_refused():
    cfg, _, _ = cli.compose_config(["recipe=zero2"])
    gen = D.deepspeed_config(cfg, 2, cuda=False)
    merged = D.merge_extra(
        gen,
        {"zero_optimization": {"round_robin_gradients": True}, "wall_clock_breakdown": False, "train_batch_size": 16},
    )  # equal to the generated value: fine
    assert merged["zero_optimization"]["round_robin_gradients"] is True
    assert merged["zero_optimization"]["stage"] == 2 and gen["zero_optimization"].get("round_robin_gradients") is None
    bad = [
        ({"train_batch_size": 64}, "recipe.zero.extra.train_batch_size=64", "train.global_batch"),
        ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps=3", "train.grad_accum"),
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage=3", "recipe.zero.stage"),
        ({"optimizer": {"params": {"lr": 1.0}}}, "optimizer.params.lr=1.0", "optim"),
        ({"bf16": {"enabled": False}}, "bf16.enabled=false", "precision"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            "offload_optimizer.device=cpu",
            "recipe.zero.offload_optimizer",
        ),
        ({"scheduler": {"type": "WarmupCosineLR"}}, "recipe.zero.extra.scheduler", "lr_factor"),
    ]
    for extra, key, owner in bad:
        with pytest.raises(C.ConfigError) as e:
            D.merge_extra(gen, extra)
        assert key in str(e.value) and owner in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "extra,words",
    [
        ({"no_such_key": 1}, ["recipe.zero.extra.no_such_key=1", "does not know"]),
        ({"checkpoint": {"tag_validashun": "Warn"}}, ["checkpoint.tag_validashun", "does not know"]),
        (
            {"zero_optimization": {"round_robin_gradientz": True}},
            ["zero_optimization.round_robin_gradientz", "DeepSpeed refuses it"],
        ),
        (
            {"zero_optimization": {"sub_group_size": -5}},
            ["zero_optimization.sub_group_size=-5", "DeepSpeed refuses it"],
        ),
        ({"optimizer": {"params": {"amsgradd": True}}}, ["optimizer.params.amsgradd", "does not take it", "amsgrad"]),
    ],
)
def test_deepspeed_parser_refuses_what_it_does_not_know(extra, words):
    cfg, _, _ = cli.compose_config(["recipe=zero2"])
    cfg.recipe.zero.extra = extra
    with pytest.raises(C.ConfigError) as e:
        D.launch_config(cfg, 2, cuda=False)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_known_extra_keys_pass_and_reach_the_file():
    cfg, _, _ = cli.compose_config(
        [
            "recipe=zero2",
            "++recipe.zero.extra.zero_optimization.round_robin_gradients=true",
            "+recipe.zero.extra.checkpoint.tag_validation=Fail",
            "+recipe.zero.extra.optimizer.params.amsgrad=true",
        ]
    )
    merged = D.launch_config(cfg, 2, cuda=False)
    assert merged["zero_optimization"]["round_robin_gradients"] is True
    assert merged["checkpoint"] == {"tag_validation": "Fail"} and merged["optimizer"]["params"]["amsgrad"] is True


def test_ranks_refuse_a_file_of_another_world_size(tmp_path):
    cfg, _, _ = cli.compose_config(["recipe=zero1"])
    (tmp_path / D.FILE).write_text(D.text(D.deepspeed_config(cfg, 2, cuda=False)))
    assert D.read(tmp_path, 2)["train_batch_size"] == 16
    with pytest.raises(RuntimeError, match="another world size"):
        D.read(tmp_path, 4)
    with pytest.raises(FileNotFoundError, match="launcher train"):
        D.read(tmp_path / "nowhere", 2)


def test_dry_run_prints_the_deepspeed_config(tmp_path, capsys):
    assert cli.main(["recipe=zero3", "--dry-run", f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    text = out.split("# ds_config.json\n", 1)[1].split("# command", 1)[0]
    assert json.loads(text)["zero_optimization"]["stage"] == 3
    assert not (tmp_path / "run").exists()


def test_the_reduce_bucket_is_resolved_for_the_ranks_backend(tmp_path, capsys):
    """A null recipe.zero.reduce_bucket_size is resolved once, by the launch side, for the
    backend the ranks use (ds_config.for_backend), and config.yaml and ds_config.json say the
    same number: on this CPU gloo's, every trainable element (gpt_tiny's 885,888) up to 5e7;
    for NCCL dim^2. A size the user set is kept; model.lora's adapters alone are reduced;
    `make plan` prices this CPU's processes with gloo's and GPUs with NCCL's."""
    from launcher.planner import plan as planner

    assert cli.main(["recipe=zero3", "--dry-run", f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "    reduce_bucket_size: 885888\n" in out.split("# ds_config.json\n", 1)[0]  # config.yaml
    ds = json.loads(out.split("# ds_config.json\n", 1)[1].split("# command", 1)[0])
    assert ds["zero_optimization"]["reduce_bucket_size"] == 885_888 == C.num_params(cli.compose_config([])[0].model)

    def bucket(*overrides: str, gloo: bool) -> int:
        return D.for_backend(cli.compose_config(["recipe=zero2", *overrides])[0], gloo).recipe.zero.reduce_bucket_size

    assert bucket(gloo=False) == 128**2
    assert bucket("recipe.zero.reduce_bucket_size=1000", gloo=True) == 1000
    assert bucket("model=gpt_1b", gloo=True) == D.GLOO_BUCKET_CAP == 50_000_000
    assert bucket("model=gpt_1b", gloo=False) == 2048**2
    lora = cli.compose_config(["recipe=zero2", "model=gpt_small", "model.lora.rank=8"])[0]
    assert bucket("model=gpt_small", "model.lora.rank=8", gloo=True) == D.trainable_elements(lora) < 2_000_000

    cfg = cli.compose_config(["recipe=zero3"])[0]
    for cpu, want in ((True, 885_888), (False, 128**2)):
        hw = planner.Hardware(gpu_bytes=2**34, gpus_per_node=2, nnodes=1, tflops=100.0, cpu=cpu)
        row = next(r for r in planner.plan(cfg, hw, {"zero3": cfg.recipe}, micro_batch=1) if r.layout.shard == "zero3")
        assert row.collectives["reduce_scatter"]["count"] == -(-885_888 // want)


def test_a_back_off_rebatches_the_json_that_deepspeed_then_reads(tmp_path):
    """train.oom_backoff on a ZeRO run: micro 8 x 1 -> 4 x 2 at the same train_batch_size."""
    cfg, _, _ = cli.compose_config(["recipe=zero2", "train.micro_batch=8"])
    (tmp_path / D.FILE).write_text(D.text(D.deepspeed_config(cfg, 2, cuda=False)))
    D.rebatch(tmp_path, 4, 2)
    read = D.read(tmp_path, 2)
    assert (read["train_micro_batch_size_per_gpu"], read["gradient_accumulation_steps"], read["train_batch_size"]) == (
        4,
        2,
        16,
    )
    with pytest.raises(ValueError, match="would change the batch"):
        D.rebatch(tmp_path, 2, 2)


def test_compiled_ops_are_cached_per_python_environment(monkeypatch, tmp_path):
    """Where torch builds and finds DeepSpeed's just-in-time ops (cpu_adam, the shared-memory
    op): one folder per Python environment under torch's cache, so two environments on one
    host never rebuild each other's ops; a TORCH_EXTENSIONS_DIR the user set is kept."""
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    def build_dir(prefix: str, user: str | None = None) -> Path:
        monkeypatch.setattr(sys, "prefix", prefix)
        if user is None:
            monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCH_EXTENSIONS_DIR", user)
        deepspeed_env()
        return Path(_get_build_directory("cpu_adam", verbose=False))

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    work, ci = build_dir(str(tmp_path / "work" / ".venv")), build_dir(str(tmp_path / "ci" / ".venv"))
    assert work != ci and work.name == ci.name == "cpu_adam"
    for path in (work, ci):
        assert path.parents[1] == tmp_path / "cache" / "torch_extensions" and path.parent.name.startswith("venv-")
    assert build_dir(str(tmp_path / "work" / ".venv")) == work  # the same environment finds its own again
    assert build_dir(str(tmp_path / "work" / ".venv"), user=str(tmp_path / "mine")).parent == tmp_path / "mine"
