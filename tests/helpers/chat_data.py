"""Chat data and a tiny chat model for the tests: scripts/tiny_chat.py's (the shipped
example's generator and the model a user makes), in session folders."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

from hf_models import session_folder
from runs import REPO

sys.path.insert(0, str(REPO / "scripts"))
from tiny_chat import SPECIAL, TEMPLATE, rows, vocabulary, write_data, write_model, write_tokenizer  # noqa: E402

EXAMPLE = REPO / "examples" / "chat" / "train.jsonl"
__all__ = ["EXAMPLE", "SPECIAL", "TEMPLATE", "chat_model", "chat_tokenizer", "rows", "vocabulary", "write_data",
           "write_model", "write_tokenizer"]


@lru_cache(maxsize=None)
def chat_tokenizer() -> Path:
    """The tiny chat model's tokenizer (its template marks generation), once per session."""
    return write_tokenizer(session_folder("launcher-chat-tok-") / "tok")


@lru_cache(maxsize=None)
def chat_model() -> Path:
    """The tiny Llama and its tokenizer in one folder, once per session."""
    return write_model(session_folder("launcher-chat-model-") / "model")
