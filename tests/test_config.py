"""Every recipe/model/data/precision combination in conf/ composes and validates."""

from __future__ import annotations

import itertools

import pytest

from hf_models import tiny_llama_config
from launcher import cli, compose
from launcher import config as C
from launcher.validate import validate
from launcher.device import HostInfo

HOST = HostInfo.detect()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (compose.CONF_DIR / group).glob("*.yaml"))


def test_every_group_has_a_schema_and_files():
    for group in C.GROUPS:
        assert options(group), f"conf/{group}/ is empty"


def test_every_config_file_opens_with_its_command():
    for path in sorted(compose.CONF_DIR.rglob("*.yaml")):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# make ") or first.startswith("# python "), f"{path} opens with {first!r}"


def pairwise(*axes: list[str]) -> list[tuple[str, ...]]:
    """Combinations that hold every pair of values of any two axes at least once (chosen
    greedily from the full product, deterministic): checks between two groups (a recipe and
    a model, a model and its data, a recipe and a precision) are all met, at about a tenth
    of the product's cost. Nothing here checks three groups at once."""
    todo = {((i, a), (j, b)) for i, j in itertools.combinations(range(len(axes)), 2)
            for a in axes[i] for b in axes[j]}
    chosen = []
    while todo:
        best = max(itertools.product(*axes), key=lambda c: sum(
            ((i, c[i]), (j, c[j])) in todo for i, j in itertools.combinations(range(len(c)), 2)))
        chosen.append(best)
        todo -= {((i, best[i]), (j, best[j])) for i, j in itertools.combinations(range(len(best)), 2)}
    return chosen


def test_pairwise_holds_every_pair():
    axes = [options("recipe"), options("model"), options("data"), options("precision")]
    combos = pairwise(*axes)
    for i, j in itertools.combinations(range(4), 2):
        assert {(c[i], c[j]) for c in combos} == set(itertools.product(axes[i], axes[j]))
    assert len(combos) < len(list(itertools.product(*axes))) // 5


@pytest.mark.parametrize("recipe,model,data,precision", pairwise(
    options("recipe"), options("model"), options("data"), options("precision")))
def test_combination_composes_and_validates(recipe, model, data, precision, tmp_path):
    overrides = [f"recipe={recipe}", f"model={model}", f"data={data}", f"precision={precision}"]
    if data == "memmap":
        tokens = tmp_path / "tokens.bin"
        tokens.write_bytes(b"\x01\x00" * 5000)
        overrides.append(f"data.path={tokens}")
    if model == "hf":
        overrides.append(f"model.config={tiny_llama_config(tmp_path / 'llama')}")
    if data == "hf_text":
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text('{"text": "a document"}\n')
        overrides.append(f"data.files={corpus}")
    cfg, run_dir, _ = cli.compose_config(overrides)
    assert cfg.recipe.name == recipe and cfg.model.name == model and cfg.precision.name.value == precision
    assert isinstance(cfg.train.activation_checkpointing, C.ACMode)
    if precision == "fp16" and not HOST.cuda:
        with pytest.raises(C.ConfigError, match="fp16 needs CUDA"):
            validate(cfg, HOST)
    elif precision == "fp16" and recipe in C.RECIPE_PARALLELISM:
        with pytest.raises(C.ConfigError, match="no fp16 loss scaler"):
            validate(cfg, HOST)
    else:
        validate(cfg, HOST)


def test_frozen_config_round_trips(tmp_path):
    cfg, _, _ = cli.compose_config(["model=gpt_small", "train.activation_checkpointing=selective"])
    (tmp_path / "config.yaml").write_text(C.to_yaml(cfg))
    again = C.load_frozen(tmp_path)
    assert again == cfg


def test_global_batch_derives_accumulation():
    cfg, _, _ = cli.compose_config(["train.global_batch=64", "train.micro_batch=4"])
    assert C.grad_accum(cfg, 2) == 8 and C.global_batch(cfg, 2) == 64


@pytest.mark.parametrize("steps", [1, 10, 20, 21])
def test_a_warmup_longer_than_the_run_is_clamped_with_a_note(steps):
    """The default warm-up is 20 steps; `train.steps=10` (a smoke test) trains, warming up
    throughout, as torchtitan does; config.yaml records the warm-up it ran with."""
    from launcher.engine import lr_factor

    cfg, _, _ = cli.compose_config([f"train.steps={steps}"])
    assert cfg.optim.warmup_steps == 20
    notes = validate(cfg, HOST)
    assert validate(cfg, HOST) == []  # the clamped value is valid
    if steps < 20:
        assert cfg.optim.warmup_steps == steps
        assert notes == [f"optim.warmup_steps=20 is longer than train.steps={steps}: warming up over all {steps} steps"]
    else:
        assert cfg.optim.warmup_steps == 20 and notes == []
    factors = [lr_factor(s, steps, cfg.optim) for s in range(steps)]
    assert all(0 < f <= 1 for f in factors)
    if steps <= 20:
        assert factors == sorted(factors) and factors[-1] == 1  # warming up throughout, to the peak


def test_the_clamp_is_said_once_and_never_beside_an_error(tmp_path, capsys):
    """Bad input stays one line (the note waits until every check passed); a sweep says it once."""
    assert cli.main(["--dry-run", "train.steps=5", "optim.lr=-1", f"hydra.run.dir={tmp_path / 'a'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: optim.lr=-1.0: must be > 0"]
    assert cli.main(["-m", "--dry-run", "train.steps=5", "train.seed=1,2", f"hydra.sweep.dir={tmp_path / 'b'}"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: optim.warmup_steps=20 is longer than train.steps=5: warming up over all 5 steps"], err


def test_a_relaunch_that_changes_the_schedule_says_so(tmp_path):
    """A run of 10 steps (its warm-up clamped to 10) continued to 40: the default warm-up of
    20 applies again, and the learning rate at step 10 falls from the peak; one line says so,
    and none when the run's warm-up is kept (optim.warmup_steps=10)."""
    from launcher.checkpoint import write_manifest
    from launcher.rundir import schedule_change

    run = tmp_path / "run"
    old, _, _ = cli.compose_config(["train.steps=10"])
    validate(old, HOST)
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "checkpoints" / "step_00000010" / "trainer.pt").write_bytes(b"x")
    write_manifest(run / "checkpoints" / "step_00000010", 10)
    (run / "config.yaml").write_text(C.to_yaml(old))
    longer, _, _ = cli.compose_config([f"hydra.run.dir={run}", "train.steps=40"])
    note = schedule_change(longer, run)
    assert note.startswith("the learning rate where this launch resumes (step 10) changes from 1 to 0.55 x optim.lr"), note
    kept, _, _ = cli.compose_config([f"hydra.run.dir={run}", "train.steps=40", "optim.warmup_steps=10"])
    assert schedule_change(kept, run) is None  # the run's warm-up kept: the peak where it resumes, then the cosine
    same, _, _ = cli.compose_config([f"hydra.run.dir={run}", "train.steps=10"])
    validate(same, HOST)
    assert schedule_change(same, run) is None


def test_a_config_yaml_of_an_earlier_version_still_loads(tmp_path):
    """config.yaml once held dry_run (a flag now): a run directory made then still resumes."""
    cfg, _, _ = cli.compose_config([])
    (tmp_path / "config.yaml").write_text(C.to_yaml(cfg) + "dry_run: false\n")
    assert C.load_frozen(tmp_path) == cfg


def test_every_strategy_is_one_row_with_an_engine():
    """launcher.config.STRATEGIES is the one list of engines: every recipe.strategy has a row,
    every conf/recipe/*.yaml chooses one, each row's module builds and consolidates, reads
    the format it writes, and the mesh-using ones are RECIPE_PARALLELISM."""
    import importlib

    from launcher.device import deepspeed_env

    assert set(C.STRATEGIES) == set(C.Strategy)
    for strategy, spec in C.STRATEGIES.items():
        assert spec.writes in spec.reads, strategy
        if strategy == C.Strategy.zero:
            deepspeed_env()
        engine = importlib.import_module(spec.module)
        assert callable(engine.build) and callable(engine.consolidate), spec.module
        assert (strategy.value in C.RECIPE_PARALLELISM) == (spec.parallelism != C.Parallelism())
    recipes = sorted(p.stem for p in (compose.CONF_DIR / "recipe").glob("*.yaml"))
    assert len(recipes) >= 10
    for name in recipes:
        cfg, _, _ = cli.compose_config([f"recipe={name}"])
        assert cfg.recipe.strategy in C.STRATEGIES, name
