"""Every recipe/model/data/precision combination in conf/ composes and validates."""

from __future__ import annotations

import itertools
import json

import pytest
from hf_models import tiny_llama_config

import engines
from launcher import config as C
from launcher.host import HostInfo, native_bf16
from launcher.launch import cli, compose
from launcher.launch.checks.validate import validate
from launcher.parallel import degrees as D

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
    todo = {((i, a), (j, b)) for i, j in itertools.combinations(range(len(axes)), 2) for a in axes[i] for b in axes[j]}
    chosen = []
    while todo:
        best = max(
            itertools.product(*axes),
            key=lambda c: sum(((i, c[i]), (j, c[j])) in todo for i, j in itertools.combinations(range(len(c)), 2)),
        )
        chosen.append(best)
        todo -= {((i, best[i]), (j, best[j])) for i, j in itertools.combinations(range(len(best)), 2)}
    return chosen


def test_pairwise_holds_every_pair():
    axes = [options("recipe"), options("model"), options("data"), options("precision")]
    combos = pairwise(*axes)
    for i, j in itertools.combinations(range(4), 2):
        assert {(c[i], c[j]) for c in combos} == set(itertools.product(axes[i], axes[j]))
    assert len(combos) < len(list(itertools.product(*axes))) // 5


@pytest.mark.parametrize(
    "recipe,model,data,precision", pairwise(options("recipe"), options("model"), options("data"), options("precision"))
)
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
    if data == "chat":
        from chat_data import chat_tokenizer, write_data

        overrides += [f"data.files={write_data(tmp_path / 'chat.jsonl', 4)}", f"data.tokenizer={chat_tokenizer()}"]
    cfg, run_dir, _ = cli.compose_config(overrides)
    assert cfg.recipe.name == recipe and cfg.model.name == model
    assert cfg.precision.name.value == precision or (precision, cfg.precision.name.value, cfg.precision.fp8) == (
        "fp8",
        "bf16",
        True,
    )
    assert isinstance(cfg.train.activation_checkpointing, C.ACMode)
    if precision == "fp8" and (not HOST.cuda or cfg.recipe.engine not in ("ddp", "fsdp")):
        with pytest.raises(C.ConfigError, match="precision=fp8"):
            validate(cfg, HOST)
    elif precision == "fp16" and not HOST.cuda:
        with pytest.raises(C.ConfigError, match="fp16 needs CUDA"):
            validate(cfg, HOST)
    elif precision == "fp16" and not engines.spec(cfg.recipe.engine).fp16:
        with pytest.raises(C.ConfigError, match="no fp16 loss scaler"):
            validate(cfg, HOST)
    elif cfg.model.moe.experts and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
        with pytest.raises(C.ConfigError, match="an MoE model"):
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
    assert D.grad_accum(cfg, 2) == 8 and D.global_batch(cfg, 2) == 64


@pytest.mark.parametrize("steps", [1, 10, 20, 21])
def test_a_warmup_longer_than_the_run_is_clamped_with_a_note(steps):
    """The default warm-up is 20 steps; `train.steps=10` (a smoke test) trains, warming up
    throughout, as torchtitan does; config.yaml records the warm-up it ran with."""
    from launcher.config import lr_factor

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
    host = [line for line in err if "no native bf16" in line]  # a CPU without native bf16: the default's note, once
    assert len(host) == (0 if native_bf16() else 1), err
    assert [line for line in err if line not in host] == [
        "warning: optim.warmup_steps=20 is longer than train.steps=5: warming up over all 5 steps"
    ], err


def test_a_relaunch_that_changes_the_schedule_says_so(tmp_path):
    """A run of 10 steps (its warm-up clamped to 10) continued to 40: the default warm-up of
    20 applies again, and the learning rate at step 10 falls from the peak; one line says so,
    and none when the run's warm-up is kept (optim.warmup_steps=10)."""
    from launcher.launch.rundir.prepare import schedule_change
    from launcher.manifest import write_manifest

    run = tmp_path / "run"
    old, _, _ = cli.compose_config(["train.steps=10"])
    validate(old, HOST)
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "checkpoints" / "step_00000010" / "trainer.pt").write_bytes(b"x")
    write_manifest(run / "checkpoints" / "step_00000010", 10)
    (run / "config.yaml").write_text(C.to_yaml(old))
    longer, _, _ = cli.compose_config([f"hydra.run.dir={run}", "train.steps=40"])
    note = schedule_change(longer, run)
    assert note.startswith("the learning rate where this launch resumes (step 10) changes from 1 to 0.55 x optim.lr"), (
        note
    )
    kept, _, _ = cli.compose_config([f"hydra.run.dir={run}", "train.steps=40", "optim.warmup_steps=10"])
    assert schedule_change(kept, run) is None  # the run's warm-up kept: the peak where it resumes, then the cosine
    same, _, _ = cli.compose_config([f"hydra.run.dir={run}", "train.steps=10"])
    validate(same, HOST)
    assert schedule_change(same, run) is None


def test_a_config_yaml_of_an_earlier_version_still_loads(tmp_path):
    """config.yaml once held dry_run (a flag now) and recipe.strategy (recipe.engine now): a
    run directory made then still resumes (ranks, relaunch and export read it through read_frozen)."""
    cfg, _, _ = cli.compose_config(["recipe=zero2"])
    old = C.to_yaml(cfg).replace("  engine: zero\n", "  strategy: zero\n")
    assert "strategy: zero" in old and "engine: zero" not in old
    (tmp_path / "config.yaml").write_text(old + "dry_run: false\n")
    assert C.load_frozen(tmp_path) == cfg


def test_every_engine_is_one_module_with_its_spec():
    """engines/ is the one list of engines: each module declares an EngineSpec (reading the
    format it writes) and names the module with build and consolidate; an engine that
    splits the model (a device mesh) shards the meta-device model; reading every spec
    imports neither torch nor DeepSpeed, and every conf/recipe/*.yaml names one of them and
    every engine has one. (The engine classes' contract: tests/unit/test_engines.py.)"""
    import subprocess
    import sys

    from runs import REPO

    modules = {p.stem for p in (REPO / "engines").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert engines.names() == sorted(modules - {"__init__"}) and len(engines.names()) >= 2
    for name, spec in engines.specs().items():
        assert spec.writes in spec.reads, name
        engine = engines.engine(name)
        assert callable(engine.build) and callable(engine.consolidate), name
        assert spec.meshed == spec.builds_on_meta, name
    assert {s.meshed for s in engines.specs().values()} == {True, False}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, engines; engines.specs(); print('torch' in sys.modules, 'deepspeed' in sys.modules)",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.strip() == "False False", proc.stderr[-2000:]
    names = sorted(p.stem for p in (compose.CONF_DIR / "recipe").glob("*.yaml"))
    assert len(names) >= 10 and set(compose.recipe_configs()) == set(names)
    used = set()
    for name in names:
        cfg, _, _ = cli.compose_config([f"recipe={name}"])
        assert cfg.recipe.engine in engines.names(), name
        assert compose.recipe_configs({name})[name] == cfg.recipe, name
        used.add(cfg.recipe.engine)
    assert used == set(engines.names())


def test_a_group_file_read_alone_is_what_composition_gives():
    """compose.group_configs reads conf/<group>/<name>.yaml without Hydra: the planner's
    recipes and scripts/measure_memory.py's precisions (swapped on one composed config)
    equal what `precision=<name>` composes."""
    names = compose.group_options("precision")
    assert names == ["bf16", "fp16", "fp32", "fp8"]
    for name in names:
        cfg, _, _ = cli.compose_config([f"precision={name}", "recipe=zero2"])
        assert compose.group_configs("precision", {name}) == {name: cfg.precision}, name


def test_a_new_engine_is_one_module_and_one_yaml(tmp_path):
    """In a copy of the project, engines/mine.py (ddp's engine, ZeRO-2's sharding declared) and
    conf/recipe/mine.yaml, and nothing else: `make plan` offers it, a dry run composes,
    validates and writes its command, and an engine with no module is refused in one line."""
    import shutil
    import subprocess
    import sys

    from runs import REPO

    for part in ("launcher", "engines", "conf", "scripts"):
        shutil.copytree(REPO / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "engines" / "mine.py").write_text(
        '"""A test engine: ddp\'s, planned as ZeRO-2."""\n'
        "from engines import Holding, EngineSpec\n\n"
        "SPEC = EngineSpec(engine='engines.ddp.engine', reads=('ddp', 'dcp'), holds=lambda recipe: Holding(shard='zero2'))\n"
    )
    (tmp_path / "conf" / "recipe" / "mine.yaml").write_text("name: mine\nengine: mine\n")

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "launcher", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )

    plan = run("plan", "model=gpt_tiny", "cluster.gpus_per_node=4", "cluster.gpu_memory_gb=80", "--json")
    assert plan.returncode == 0, plan.stderr[-2000:]
    mine = [r["layout"] for r in json.loads(plan.stdout)["rows"] if r["layout"]["recipe"] == "mine"]
    assert mine and all(lay["shard"] == "zero2" and lay["dp"] == 4 for lay in mine), mine
    dry = run("train", "recipe=mine", f"hydra.run.dir={tmp_path / 'run'}", "--dry-run")
    assert dry.returncode == 0 and "-m launcher.rank" in dry.stdout, dry.stdout[-2000:] + dry.stderr[-2000:]
    bad = run("train", "recipe=mine", "recipe.engine=nope", f"hydra.run.dir={tmp_path / 'bad'}", "--dry-run")
    allowed = ", ".join(sorted([*engines.names(), "mine"]))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: recipe.engine=nope: no such engine; allowed: {allowed} (engines/<engine>: a module or package; "
        "a recipe, conf/recipe/<name>.yaml, names one)"
    ], bad.stderr


def test_config_yaml_holds_every_string_as_typed(tmp_path):
    """Issue 47, 3: a `${` in any string (escaped ones, backslashes before it, nested) is
    written escaped and read back by the ranks' reader as the same characters."""
    import dataclasses

    from launcher.launch.compose import compose_config

    cfg, _, _ = compose_config([r"run_name='\${oc.env:HOME}'"])
    odd = ["${oc.env:HOME}", "a\\${b}", "a\\\\${b}", "${${x}}", "$${x}", "plain\\x"]
    cfg = dataclasses.replace(
        cfg,
        run_name=odd[0],
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=odd[1]),
        logger=dataclasses.replace(cfg.logger, tags=odd),
    )
    (tmp_path / "config.yaml").write_text(C.to_yaml(cfg))
    back = C.load_frozen(tmp_path)
    assert (back.run_name, back.checkpoint.dir, back.logger.tags) == (odd[0], odd[1], odd)
