"""`launcher data [key=value ...]` (`make data`): prepare data=hf_text (or data=chat) into the shared cache
now, without training; `make train` with the same data.* then reuses it (or does the same
preparation itself when nobody ran this first)."""

from __future__ import annotations

import shlex
import sys

from launcher import config as C
from launcher.exits import EXIT_INTERRUPTED
from launcher.launch.compose import compose_config
from launcher.launch.start.supervise import interrupts_held


def cmd_data(overrides: list[str]) -> int:
    """Compose (data=hf_text unless the overrides name it), validate the data's own fields,
    files and tokenizer (no model: the prepared data serves any model its vocabulary fits),
    prepare, say where."""
    from launcher.data.cache import describe, prepare  # local: start-up (numpy, 0.75 s, launch side)
    from launcher.data.prepare import validate_chat, validate_hf_text  # local: start-up (numpy, 0.75 s, launch side)

    with interrupts_held():
        named = any(o.split("=", 1)[0].lstrip("+~") == "data" for o in overrides)
        cfg, _, _ = compose_config(overrides if named else ["data=hf_text", *overrides])
        if cfg.data.name not in (C.DataKind.hf_text, C.DataKind.chat):
            raise C.ConfigError(
                "data",
                cfg.data.name.value,
                "make data prepares data=hf_text (local JSON lines, "
                "parquet or text files and a tokenizer) or data=chat (conversations); leave data= out, "
                "or name one of them",
            )
        (validate_chat if cfg.data.name == C.DataKind.chat else validate_hf_text)(cfg, against_model=False)
    try:
        got = prepare(cfg)
    except KeyboardInterrupt:
        print(
            "interrupted (Ctrl-C): the shards written so far are kept; `make data` again with the same "
            "data.* continues where it stopped",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    index = got.index
    shards = len(index["shards"])
    what = "conversations" if cfg.data.name == C.DataKind.chat else "documents"
    print(
        f"data: {index['documents']:,} {what}, {index['tokens']:,} tokens ({index['dtype']}, {shards} "
        f"shard{'s' if shards != 1 else ''}); {describe(got)}",
        flush=True,
    )
    same = " ".join(
        shlex.quote(o) for o in [f"data={cfg.data.name.value}", *(o for o in overrides if o.startswith("data."))]
    )
    memmap = "" if cfg.data.name == C.DataKind.chat else f" (or data=memmap data.path={shlex.quote(str(got.dir))})"
    print(f'train on it: make train ARGS="{same}"{memmap}', flush=True)
    return 0
