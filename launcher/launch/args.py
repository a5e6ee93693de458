"""The command line: `launcher [COMMAND] [flags] [key=value ...]` parsed into Args, each
command's flags real argparse flags (never keys of config.yaml), everything else a Hydra
override checked for its syntax; `launcher COMMAND --help` prints the command's flags."""

from __future__ import annotations

import argparse
from typing import NamedTuple

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from launcher.launch.compose import UsageError

COMMANDS = ("train", "export", "plan", "submit", "rehearse", "data")


USAGE = """usage: launcher train [key=value ...] [--dry-run] [-m|--multirun]
       launcher plan [key=value ...] [--json]
       launcher submit [key=value ...] [--dry-run] [-m|--multirun]   (a Slurm job, cluster=slurm; or cluster=k8s)
       launcher export RUN_DIR [export.key=value ...]
       launcher rehearse [key=value ...] [--ranks R,R,...] [--json]   (ranks of a cluster's layout, built here on meta)
       launcher data [data.key=value ...]   (data=hf_text or chat tokenized into the shared cache)
       launcher COMMAND --help   (the command's flags)"""


ABOUT = {
    "train": "Compose conf/ with the overrides, validate, write the run directory and start the ranks here "
    "(torchrun, deepspeed or accelerate launch: cluster.runner).",
    "submit": "As train, as a Slurm job (cluster=slurm, the default) or as Kubernetes pods (cluster=k8s).",
    "plan": "The memory plan of the composed run: each layout and micro-batch on its cluster, and what fits.",
    "rehearse": "Ranks of the cluster's layout built here on the meta device, against the plan.",
    "export": "RUN_DIR's checkpoint as safetensors: the full model, consolidated from its shards.",
    "data": "data=hf_text (or data=chat) tokenized into the shared cache, by every core, before a run needs it.",
}


class Args(NamedTuple):
    command: str
    overrides: list[str]
    dry_run: bool = False
    multirun: bool = False
    as_json: bool = False
    ranks: str | None = None
    help: str | None = None  # `launcher COMMAND --help`: the text to print, and nothing is run


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 (main), not argparse's usage block
        raise UsageError(f"{self.prog}: {message} (launcher --help)")


def parse_args(argv: list[str]) -> Args:
    """`launcher [COMMAND] [flags] [key=value ...]`; COMMAND defaults to train. Flags are
    flags (never written into config.yaml); everything else is a Hydra override."""
    command = "train"
    if argv and not argv[0].startswith("-") and "=" not in argv[0]:
        command, argv = argv[0], argv[1:]
        if command not in COMMANDS:
            raise UsageError(f"unknown command '{command}'; allowed: {', '.join(COMMANDS)}")
    parser = _Parser(
        prog=f"launcher {command}",
        add_help=False,
        allow_abbrev=False,
        description=ABOUT[command],
        epilog="Overrides are Hydra's key=value on conf/ (model=gpt_350m optim.lr=3e-4; export: "
        "export.dtype=bf16); every option, its default and its allowed values: conf/ and launcher/config/.",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="RUN_DIR key=value" if command == "export" else "key=value",
        help="the run directory, then overrides" if command == "export" else "Hydra overrides",
    )
    parser.add_argument("-h", "--help", action="store_true", help="this text; nothing runs")
    if command in ("train", "submit"):
        parser.add_argument("--dry-run", action="store_true", help="print the run's files and command; start nothing")
        parser.add_argument("-m", "--multirun", action="store_true", help="a sweep: one run per point")
    if command in ("plan", "rehearse"):
        parser.add_argument("--json", action="store_true", dest="as_json", help="the table as JSON")
    if command == "rehearse":
        parser.add_argument(
            "--ranks",
            default=None,
            help="comma-separated ranks (default: first, last, each stage's first, each tensor-parallel position)",
        )
    parsed, unknown = parser.parse_known_intermixed_args(argv)
    if parsed.help:
        return Args(command, [], help=parser.format_help())
    if unknown:  # the command's own flags, as the parser has them, then -h/--help
        flags = sorted((a for a in parser._actions if a.option_strings), key=lambda a: a.dest == "help")
        raise UsageError(
            f"unknown flag '{unknown[0]}' for {command}; allowed: "
            f"{', '.join('/'.join(a.option_strings) for a in flags)}, or key=value overrides"
        )
    args = Args(
        command,
        parsed.overrides,
        getattr(parsed, "dry_run", False),
        getattr(parsed, "multirun", False),
        getattr(parsed, "as_json", False),
        getattr(parsed, "ranks", None),
    )
    overrides_parser = OverridesParser.create()
    for o in args.overrides if command in ("train", "submit", "data") else []:
        try:
            overrides_parser.parse_overrides([o])
        except HydraException as e:
            raise UsageError(f"{o}: cannot parse ({str(e).splitlines()[0]}); overrides look like key=value")
    return args
