"""Composing the Hydra config (conf/, the compose API: every error one line) and the
words for what went wrong: an unknown group option, a wrong type, a missing value.
"""

from __future__ import annotations

import contextlib
import enum
import re
from pathlib import Path
from typing import Any, cast

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from launcher import config as C

REPO = Path(__file__).resolve().parents[2]


CONF_DIR = REPO / "conf"


class UsageError(Exception):
    """Bad input that is not about one config key."""


def compose_config(overrides: list[str]) -> tuple[C.Config, Path, Any]:
    """Compose conf/ with the overrides; return the typed config, the run directory
    Hydra resolved (hydra.run.dir, ${now:} evaluated once, here) and Hydra's node."""
    refuse_renamed(overrides)
    C.register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        node = compose("config", overrides=overrides, return_hydra_config=True)
    hydra_node = node.hydra
    run_dir = Path(str(hydra_node.run.dir))
    with open_dict(node):
        del node["hydra"]
    return C.to_typed(node), run_dir, hydra_node


def refuse_renamed(overrides: list[str]) -> None:
    """An override of a key that has a new name (C.RENAMED): one line naming the new key and
    the same value, not Hydra's unknown key."""
    for o in overrides:
        key, _, value = o.partition("=")
        new = C.RENAMED.get(key.lstrip("+~"))
        if new:
            raise C.ConfigError(key.lstrip("+~"), value, f"renamed; use {new}={value}")


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Hydra's sweep syntax (`optim.lr=1e-3,3e-3`) -> one override list per point."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [list(point) for batch in batches for point in batch]


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def group_configs(group: str, names: set[str] | None = None) -> dict:
    """conf/<group>/<name>.yaml as typed configs of that group (the node alone, without the
    files its defaults list takes from other groups): the planner reads the recipes this way
    (the degrees a recipe takes from conf/parallel/ are the planner's to choose), and
    scripts/measure_memory.py swaps precisions on one composed config."""
    out = {}
    for name in group_options(group):
        if names is None or name in names:
            node = cast(DictConfig, OmegaConf.load(CONF_DIR / group / f"{name}.yaml"))
            node.pop("defaults", None)
            out[name] = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(C.GROUPS[group]), node))
    return out


def recipe_configs(names: set[str] | None = None) -> dict[str, C.RecipeConfig]:
    """conf/recipe/<name>.yaml as typed recipe configs, for `make plan`."""
    return group_configs("recipe", names)


def describe(e: BaseException) -> str:
    """One line for a composition or validation error: key, value, what is allowed."""
    if isinstance(e, C.ConfigError):
        return str(e)
    if isinstance(e, MissingConfigException):
        text = str(e)
        for group in C.GROUPS:
            if f"'{group}/" in text:
                name = text.split(f"'{group}/", 1)[1].split("'", 1)[0]
                allowed = group_options(group) + (["auto (the planner chooses)"] if group == "recipe" else [])
                return f"{group}={name}: no such {group}; allowed: {', '.join(allowed)}"
        return text.splitlines()[0]
    # The OmegaConf error in the chain that names a key carries the reason.
    chain, inner = [], e
    while inner is not None and inner not in chain:
        chain.append(inner)
        inner = inner.__cause__ or inner.__context__
    for err in chain:
        if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
            return _describe_omegaconf(err)
    text = str(e).strip()
    return text.splitlines()[0] if text else e.__class__.__name__


def _describe_omegaconf(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or "?"
    msg = str(getattr(e, "msg", "") or e).strip().splitlines()[0]
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)) and key in C.RENAMED:  # a recipe file of the user's
        return f"{key}: renamed; use {C.RENAMED[key]}"
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)) and "not in" in msg:
        parent, _, leaf = key.rpartition(".")
        schema = C.GROUPS.get(parent.split(".")[0]) if parent else C.Config
        allowed = ""
        if schema is not None:
            node = OmegaConf.structured(schema)
            with contextlib.suppress(OmegaConfBaseException, KeyError):  # a key with dots in it: no list
                for part in parent.split(".")[1:]:
                    node = node[part]
                allowed = "; allowed keys: " + ", ".join(node.keys()) if len(node) else ""
        return f"{key}: unknown key{allowed}"
    if isinstance(e, MissingMandatoryValue):
        return f"{key}: missing; it must be given (e.g. {key}=...)"
    if isinstance(e, ValidationError):
        value = getattr(e, "value", None)
        if "expected one of" in msg:
            allowed = msg.split("expected one of", 1)[1].strip()
            return f"{key}={value}: not allowed; allowed: {allowed.strip('[]')}"
        if choice := _enum_named(msg):  # a number given to a choice (1.5, nan): its words, as for a wrong word
            return f"{key}={value}: not allowed; allowed: {', '.join(m.name for m in choice)}"
        want = "the declared type"
        if "converted to" in msg:
            want = msg.split("converted to", 1)[1].strip()
        elif "is not a valid" in msg:
            want = msg.split("is not a valid", 1)[1].split()[0].capitalize().replace("Bool", "Boolean")
        names = {"Integer": "int", "Float": "float", "Boolean": "bool (true/false)", "String": "str"}
        return f"{key}={value}: wrong type; expected {names.get(want, want)}"
    return f"{key}: {msg}"


def _enum_named(msg: str) -> type[enum.Enum] | None:
    """The choice (an Enum of launcher.config) OmegaConf names in "Value 1.5 (float) is not a
    valid input for <enum 'ACMode'>", or None."""
    found = re.search(r"<enum '(\w+)'>", msg)
    choice = getattr(C, found.group(1), None) if found else None
    return choice if isinstance(choice, type) and issubclass(choice, enum.Enum) else None
