#!/usr/bin/env python
"""Turn a local text file into a flat token file for `data=memmap` (no downloads).

Byte-level: every UTF-8 byte is one token (vocabulary 256), written as uint16 like
nanoGPT's train.bin.

    python scripts/prepare_data.py --input corpus.txt --output data/corpus.bin
    make train ARGS="data=memmap data.path=data/corpus.bin"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from launcher.config import TokenDtype
from launcher.data.read import write_tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, type=Path, help="a UTF-8 text file")
    ap.add_argument("--output", required=True, type=Path, help="where the .bin goes")
    args = ap.parse_args(argv)
    if not args.input.is_file():
        print(f"error: --input {args.input}: no such file", file=sys.stderr)
        return 2
    tokens = np.frombuffer(args.input.read_bytes(), dtype=np.uint8)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_tokens(tokens, args.output, TokenDtype.uint16)
    print(f"{args.output}: {len(tokens):,} tokens (byte-level, vocab 256, uint16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
