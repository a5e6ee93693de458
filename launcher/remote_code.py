"""Hugging Face folders that ask to run their own code: refused, never run (no torch, no
transformers). The launcher never passes trust_remote_code=True; a model or tokenizer folder
whose config names custom code (`auto_map`) is refused in one line by the loads that read
it (launcher/models/hf.py, launcher/data/inputs.py) before transformers could ask."""

from __future__ import annotations

import json
from pathlib import Path

CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def remote_code(folder: Path) -> str | None:
    """What in a Hugging Face folder (or a config.json) asks transformers to run the folder's
    own code (`auto_map`: transformers would ask "run the custom code? [y/N]" mid-launch, and
    a piped `y` runs it); None when nothing does. The launcher never passes
    trust_remote_code=True: such a folder is refused in one line."""
    folder = Path(folder)
    for path in [folder] if folder.is_file() else [folder / name for name in CODE_FILES]:
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(raw, dict) and raw.get("auto_map"):
            names = ", ".join(sorted(raw["auto_map"])) if isinstance(raw["auto_map"], dict) else str(raw["auto_map"])
            return (
                f"{path} names custom code (auto_map: {names}), which the launcher never runs "
                "(trust_remote_code stays off): use a model or tokenizer transformers implements itself"
            )
    return None
