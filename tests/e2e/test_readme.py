"""Every command line the README shows, and the docs pages its sections moved to, run the
way a user types it, so that they cannot drift from the program: a line that stops
working, or a new line nobody runs, fails here.

The lines are read from README.md and PAGES themselves: code-block lines that start a
command, and inline commands that carry arguments. Placeholders (`outputs/<run>`, `path/to/folder`,
`...`) become real things made here: a run trained by the README's own fsdp line
(shortened to 2 steps), a tiny Llama saved with save_pretrained, a corpus. `make` lines go
through the real Makefile (`make -n` prints the command it would run, which then runs in
this process); a `make train`/`make submit` line runs as `--dry-run` (everything is
composed, validated and planned; nothing starts), every other line runs for real. The one
line that needs a Slurm cluster is run by tests/e2e/test_slurm_runs.py (ELSEWHERE)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from runs import REPO

from launcher.host import HostInfo
from launcher.launch import cli

README = REPO / "README.md"
PAGES = tuple(REPO / "docs" / f"{name}.md" for name in ("recipes", "runs", "launching", "models"))
"""The docs pages that took the README's sections (issue 50): their lines are the README's."""
BIN = Path(sys.executable).parent  # the environment running the suite: `make test`'s .venv/bin
STARTS = ("make ", ".venv/bin/", "cd RUN_DIR ", "RUN_DIR/")
TESTED = ".venv/.installed-test"  # the test set-up (make test, gpu-check); like .venv/.installed, never remade here


def shell_env() -> dict[str, str]:
    """A user's shell, not the parent make of CI's `make test`: under MAKELEVEL a sub-make
    prints "make[1]: Entering directory" on stdout, which the user never sees."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}


def make_n(target: str) -> subprocess.CompletedProcess:
    """What `make -s -n TARGET` would run, the set-up taken as done."""
    return subprocess.run(
        ["make", "-s", "-n", "-o", ".venv/.installed", "-o", TESTED, target],
        cwd=REPO,
        env=shell_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def readme_commands() -> list[str]:
    """The command lines of the README and PAGES, in order, without their trailing comments."""
    text = "\n".join(page.read_text() for page in (README, *PAGES))
    found = [
        re.sub(r"\s+# .*$", "", line.strip())
        for line in text.splitlines()
        if line.startswith("    ") and line.strip().startswith(STARTS)
    ]
    found += [
        span for span in re.findall(r"`((?:make |\.venv/bin/)[^`\n]*)`", text) if re.search(r" (\S+=|--|\|)", span)
    ]
    return list(dict.fromkeys(found))


def readme_line(line: str) -> str:
    """A command line as the README or a page of PAGES shows it (for the tests that run it elsewhere)."""
    assert line in readme_commands(), f"neither the README nor {[p.name for p in PAGES]} shows {line!r}"
    return line


# Lines that need more than this file has: run by the named test.
ELSEWHERE = {"cd RUN_DIR && sbatch job.sbatch": "tests/e2e/test_slurm_runs.py::test_submitted_job_runs_to_completion"}

FIXTURE_LINE = 'make train RECIPE=fsdp ARGS="hydra.run.dir=outputs/a"'
SHORT = [
    "train.steps=2",
    "optim.warmup_steps=0",
    "checkpoint.every=2",
    "logger.mode=offline",
    "logger.also=[tensorboard]",
]
"""The fixture's run: the README's fsdp line for 2 steps, with TensorBoard beside W&B (the
README's TensorBoard and `wandb sync` lines read it)."""
CKPT = "outputs/a/checkpoints/step_00000002"
PLACES = {
    "outputs/<run>": "outputs/a",
    "outputs/a/checkpoints/step_00000200": CKPT,
    "checkpoint.resume=...": f"checkpoint.resume={CKPT}",
    "model.pretrained=...": "model.pretrained=tiny_llama",
    "path/to/hf_folder": "tiny_llama",
    "path/to/folder": "tiny_llama",
    "path/to/config.json": "tiny_llama/config.json",
    "path/to/tokenizer": "tok",
    # node 0 must be this machine, and tests send nothing to other addresses
    "cluster.master_addr=10.0.0.1": "cluster.master_addr=127.0.0.1",
    "hydra.run.dir=/shared/runs/x": "hydra.run.dir=shared/runs/x",
    # a Kubernetes job's run directory lies under the shared volume's mount, an absolute path
    "cluster.k8s.mount_path=/shared": "cluster.k8s.mount_path={home}/shared",
    "hydra.run.dir=/shared/runs/a": "hydra.run.dir={home}/shared/runs/a",
    "hydra.run.dir=/shared/runs/b": "hydra.run.dir={home}/shared/runs/b",
    "RUN_DIR": "outputs/a",
}
PLAN_LINE = 'make plan ARGS="model=gpt_7b cluster.gpus_per_node=8 cluster.gpu_memory_gb=80 train.seq_len=4096"'


def concrete(line: str) -> list[str]:
    """The commands a README line stands for here: placeholders filled in; an optional
    `[x=y]` gives two commands (without it and with it)."""
    for text, value in PLACES.items():
        line = line.replace(text, value)
    if line.startswith('make plan ARGS="... --json"'):
        line = PLAN_LINE[:-1] + ' --json" | jq'
    optional = re.search(r" \[(\S+)\]", line)
    if optional:
        return [line.replace(optional.group(0), ""), line.replace(optional.group(0), " " + optional.group(1))]
    return [line]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A user's working folder: the README's fsdp run trained for 2 steps into outputs/a,
    a tiny Llama saved by transformers, a JSON-lines corpus and a text file."""
    import torch
    from hf_models import TINY_LLAMA
    from transformers import AutoModelForCausalLM, LlamaConfig

    home = tmp_path_factory.mktemp("home")
    (home / "corpus").mkdir()
    shutil.copy(REPO / "tests" / "data" / "hf" / "corpus.jsonl", home / "corpus" / "corpus.jsonl")
    (home / "corpus.txt").write_text("a small corpus, byte by byte.\n" * 40)
    from corpus import WORDS, make_tokenizer

    make_tokenizer(home / "tok", list(WORDS))
    shutil.copytree(REPO / "examples", home / "examples")  # the shipped chat file, as in a clone
    from chat_data import write_model

    write_model(home / "tiny_chat")  # the README's `scripts/tiny_chat.py model tiny_chat`, for the lines that use it
    torch.manual_seed(0)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    AutoModelForCausalLM.from_config(LlamaConfig(**fields)).save_pretrained(home / "tiny_llama")
    argv = launcher_argv(FIXTURE_LINE)
    proc = subprocess.run(
        [sys.executable, "-m", "launcher", *argv, *SHORT],
        cwd=home,
        env=shell_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (home / CKPT / "manifest.json").is_file()
    return home


def launcher_argv(line: str, *more: str) -> list[str]:
    """What the Makefile runs for a `make` line (`make -n` prints it): the launcher's argv.
    `more` joins ARGS (a --dry-run)."""
    words = shlex.split(line)
    if more:
        args = next((i for i, w in enumerate(words) if w.startswith("ARGS=")), None)
        if args is None:
            words.append("ARGS=" + " ".join(more))
        else:
            words[args] += " " + " ".join(more)
    proc = subprocess.run(
        ["make", "-s", "-n", "-o", ".venv/.installed", *words[1:]],
        cwd=REPO,
        env=shell_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    command = proc.stdout.strip().splitlines()[-1]
    argv = shlex.split(command)
    assert argv[:3] == [".venv/bin/python", "-m", "launcher"], command
    return argv[3:]


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    command = command.replace(".venv/bin/", f"{BIN}/").replace(" scripts/", f" {REPO}/scripts/")
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=shell_env(), capture_output=True, text=True, timeout=300
    )


# ----------------------------------------------------------------------------- the list
def test_the_readme_lines_are_found_and_each_one_has_a_way_to_run():
    lines = readme_commands()
    for line in (
        "make train",
        "make test",
        FIXTURE_LINE,
        PLAN_LINE,
        'make plan ARGS="... --json" | jq',
        '.venv/bin/launcher train recipe=ddp train.steps=300; echo "exit $?"',
        ".venv/bin/tensorboard --logdir outputs/<run>/tensorboard",
        *ELSEWHERE,
    ):
        assert line in lines, line
    assert len(lines) >= 40, lines
    assert not [line for line in lines if "#" in line], "a trailing comment was kept"
    for text in PLACES:
        assert any(text in line for line in lines), f"placeholder {text!r} is in no README line any more"


# ----------------------------------------------------------------------------- every line
@pytest.mark.slow
@pytest.mark.parametrize("line", [line for line in readme_commands() if line not in ELSEWHERE])
def test_the_readme_line_does_what_it_says(line, home, monkeypatch, capsys):
    monkeypatch.chdir(home)
    for command in concrete(line):
        command = command.replace("{home}", str(home))
        out = run(command, home, capsys)
        check(command, out, home)


def run(command: str, home: Path, capsys) -> str:
    """Runs one concrete command; returns what it printed. Fails on a non-zero exit."""
    head = command.split()[:2]
    if head in (["make", "train"], ["make", "submit"]):
        argv = launcher_argv(command, *([] if "--dry-run" in command else ["--dry-run"]))
        return in_process(argv, command, capsys)
    if head in (["make", "plan"], ["make", "export"], ["make", "data"]) and "|" not in command:
        return in_process(launcher_argv(command), command, capsys)
    if "| jq" in command:  # make itself, to show it prints only what the program prints
        proc = subprocess.run(
            shlex.split(command.split(" | ")[0]) + [f"PY={sys.executable}", "-o", ".venv/.installed"],
            cwd=REPO,
            env=shell_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    elif head == ["make", "test"]:  # this suite: make runs pytest over tests/, which holds this file
        proc = make_n("test")
        *first, last = proc.stdout.splitlines()
        lint = make_n("lint").stdout.splitlines()
        assert first == lint and [line.split()[2] for line in lint] == ["ruff", "ruff", "mypy"]  # make lint first
        words = last.split()  # pytest-xdist workers: half the cores, 2 on 2 cores (the Makefile's TEST_WORKERS)
        cores = len(os.sched_getaffinity(0))  # what nproc counts
        workers = str(cores // 2 if cores > 4 else 2)
        assert words == [
            ".venv/bin/python",
            "-m",
            "pytest",
            "-q",
            "-n",
            workers,
            "--dist",
            "loadfile",
            "--durations=25",
            "tests",
        ], proc.stdout
        assert REPO / "tests" in Path(__file__).parents
    elif head[0] == "make":  # make rehearse builds a 70B layout's ranks: a minute alone, more on a busy machine
        proc = subprocess.run(
            [*shlex.split(command), "-o", ".venv/.installed", "-o", TESTED],
            cwd=REPO,
            env=shell_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
    elif "/launcher train" in command:  # the console script, for its own exit code
        proc = shell(command.replace("; echo", " --dry-run; echo"), home)
    elif "wandb sync" in command:  # uploading needs the network: say what would be synced
        proc = shell(command + " --dry-run", home)
    elif "tensorboard --logdir" in command:  # a server: read the event files it would serve instead
        proc = shell(command + " --inspect", home)
    else:
        proc = shell(command, home)
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def in_process(argv: list[str], command: str, capsys) -> str:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"{command}: exit {code}\n{out[-3000:]}\n{err[-3000:]}"
    return out + err


def check(command: str, out: str, home: Path) -> None:
    """What the line says it does, read back."""
    run_a = home / "outputs" / "a"
    if command.startswith(("make train", "make submit")):
        points = 2 if " -m " in command or '"-m ' in command else 1
        marker = (
            ("# Kubernetes job for the run directory" if "cluster=k8s" in command else "#!/bin/bash")
            if command.startswith("make submit")
            else "# command"
        )
        assert out.count(marker) == points, out[-2000:]
        assert "planner chose: " in out if "RECIPE=auto" in command else True
    elif command.startswith("make data"):
        cache = Path(os.environ["LAUNCHER_DATA_CACHE"])  # tests/conftest.py: the session's, never ~/.cache
        assert "prepared data " in out and list(cache.glob("*/index.json")), out[-2000:]
    elif command.startswith("make export"):
        suffix = "-hf" if "format=hf" in command else "-bf16" if "dtype=bf16" in command else ""
        folder = run_a / "export" / f"step_00000002{suffix}"
        assert (folder / ("config.json" if suffix == "-hf" else "model.safetensors")).is_file(), out
    elif command.startswith("make plan"):
        if "--json" in command:
            assert sum(row["recommended"] for row in json.loads(out)["rows"]) == 1, out[:500]
        else:
            assert "recommended: make train" in out, out[-2000:]
    elif command == "make help":
        assert all(f"make {t}" in out for t in ("train", "plan", "submit", "export", "test")), out
    elif command.startswith(".venv/bin/launcher"):
        assert "exit 0" in out.splitlines(), out[-500:]  # stdout's last line; the warnings (stderr) follow it
    elif "wandb sync" in command:
        assert "offline-run-" in out, out
    elif "tensorboard" in command:
        assert "loss" in out, out[-2000:]
    elif "tiny_chat.py model" in command:
        assert (home / "tiny_chat" / "chat_template.jinja").is_file() and (home / "tiny_chat" / "config.json").is_file()
    elif "prepare_data.py" in command:
        assert (home / "data" / "corpus.bin").stat().st_size == 2 * len((home / "corpus.txt").read_bytes())
    elif command == "outputs/a/command.sh":  # the run is finished: it says so and rewrites nothing
        assert "nothing to train: " in out, out
        assert json.loads((run_a / "summary.json").read_text())["steps_this_launch"] == 2


# ----------------------------------------------------------------------------- the first tasks
# A new user's three first tasks (issue 48), each from the README's own lines. The rest of
# each is proven where the suite already runs it: a corpus of one's own learns
# (tests/e2e/test_hf_text_runs.py::test_fsdp_hf_text_parquet_with_a_local_tokenizer), a
# Hugging Face model fine-tuned, exported and loaded by transformers
# (tests/e2e/test_hf_model_runs.py::test_export_hf_loads_with_from_pretrained_and_gives_the_trained_logits).
DATA_LINE = """make data ARGS="data.files='corpus/*.jsonl' data.tokenizer=path/to/tokenizer\""""


@pytest.mark.slow
def test_make_data_says_the_train_command_that_trains_on_it(home, monkeypatch, capsys):
    """`make data`'s closing line is a command that trains on that data: it led into
    training on synthetic data when it said `make train ARGS="<the same data.*>"`."""
    monkeypatch.chdir(home)
    out = run(concrete(readme_line(DATA_LINE))[0], home, capsys)
    hint = next(line for line in out.splitlines() if line.startswith("train on it: "))
    command = hint.removeprefix("train on it: ").split(" (or data=memmap", 1)[0]
    printed = in_process(launcher_argv(command, "--dry-run", "hydra.run.dir=outputs/own"), command, capsys)
    assert "data:\n  name: hf_text\n" in printed and "files: corpus/*.jsonl" in printed, printed[:1500]


@pytest.mark.slow
def test_the_planners_recommended_command_passes_a_dry_run_here(home, monkeypatch, capsys):
    """Pasted on the machine that planned it, with --dry-run: checked as a plan for the
    nodes it names (it failed on this machine's disk, issue 48); what only those nodes
    can answer is said so."""
    monkeypatch.chdir(home)
    for line in (
        PLAN_LINE,
        'make plan ARGS="model=llama3_8b cluster.gpus_per_node=8 cluster.gpu_memory_gb=24 train.seq_len=4096"',
    ):
        out = in_process(launcher_argv(line), line, capsys)
        command = next(x for x in out.splitlines() if x.startswith("recommended: ")).removeprefix("recommended: ")
        printed = in_process(launcher_argv(command, "--dry-run"), command, capsys)
        assert "# command" in printed, printed[-2000:]
        if not HostInfo.detect().cuda:
            assert (
                "this machine has no GPU: the GPUs, their memory and the checkpoint disk are checked where it "
                "launches" in printed
            ), printed[-2000:]
