"""data=hf_text without a training run: every file format gives the documents' bytes and EOS,
a local tokenizer and the cache key, and the bad input table of this source. The parallel
preparation itself (units, resume, the lock, `make data`): tests/unit/test_data_prepare.py.
The runs (resume, TensorBoard, the profiler): tests/e2e/test_hf_text_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from corpus import WORDS, cached_tokens, documents, make_tokenizer, write_jsonl, write_parquet
from runs import assert_refused

from launcher import config as C
from launcher.data.cache import ENV
from launcher.data.inputs import BYTE_EOS, load_tokenizer
from launcher.data.prepare import prepare_cache, token_file_config
from launcher.launch import cli
from launcher.launch.checks.validate import validate


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """The shared cache of prepared data, this test's own (never ~/.cache)."""
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def compose(*overrides: str) -> C.Config:
    return cli.compose_config(["data=hf_text", *overrides])[0]


def test_every_format_gives_the_documents_bytes_and_eos(tmp_path):
    docs = documents(50)
    expected = np.concatenate(
        [np.frombuffer(d.encode(), np.uint8).astype(np.int64).tolist() + [BYTE_EOS] for d in docs]
    )
    (tmp_path / "txt").mkdir()
    # plain text: one document per line, split over two files (read in sorted order)
    (tmp_path / "txt" / "a.txt").write_text("\n".join(docs[:20]) + "\n")
    (tmp_path / "txt" / "b.txt").write_text("\n".join(docs[20:]) + "\n\n")  # empty lines add nothing
    sources = {
        "jsonl": ["data.files=" + str(write_jsonl(tmp_path / "c.jsonl", docs))],
        "parquet": ["data.files=" + str(write_parquet(tmp_path / "c.parquet", docs)), "data.text_field=body"],
        "text": [f"data.files={tmp_path}/txt/*.txt"],
    }
    for name, overrides in sources.items():
        cfg = compose(*overrides)
        validate(cfg, cli.HostInfo.detect())
        line = prepare_cache(cfg, tmp_path / name)
        assert "documents" in line and "built" in line, line
        tokens, meta = cached_tokens(tmp_path / name)
        assert meta["documents"] == len(docs) and meta["tokens"] == len(expected) and meta["dtype"] == "uint16"
        assert np.array_equal(tokens, expected), name
        # The ranks read the prepared directory (the folder holding index.json), in its width.
        data = token_file_config(cfg, tmp_path / name)
        assert (
            data.path == meta["dir"] and Path(data.path, "index.json").is_file() and data.dtype == C.TokenDtype.uint16
        )


def test_local_tokenizer_and_cache_key(tmp_path, cache_dir):
    docs = documents(40)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    tok_dir = make_tokenizer(tmp_path / "tok", WORDS + docs[1].split())
    run = tmp_path / "run"
    cfg = compose(f"data.files={corpus}", f"data.tokenizer={tok_dir}")
    validate(cfg, cli.HostInfo.detect())
    assert "built" in prepare_cache(cfg, run)
    tokens, meta = cached_tokens(run)
    hf = load_tokenizer(str(tok_dir)).tok
    eos = hf.convert_tokens_to_ids("<eos>")
    expected = [t for d in docs for t in hf(d, add_special_tokens=False)["input_ids"] + [eos]]
    assert tokens.tolist() == expected and meta["eos_id"] == eos and meta["vocab_size"] == len(hf) < 256
    first = meta["dir"]

    assert Path(first).parent == cache_dir and not list((run / "data").glob("hf_text-*"))  # nothing in the run

    # Same inputs: reused, by this run and by another one. Another train.seq_len too: windows
    # are cut when the ranks read. A changed file or tokenizer: another directory; the first
    # one stays in the shared cache (another run may read it).
    assert "reused" in prepare_cache(cfg, run)
    assert "reused" in prepare_cache(cfg, tmp_path / "other_run")
    assert "reused" in prepare_cache(
        compose(f"data.files={corpus}", f"data.tokenizer={tok_dir}", "train.seq_len=64"), run
    )
    write_jsonl(corpus, docs[:-1])
    line = prepare_cache(cfg, run)
    assert "built" in line and "inputs changed" in line
    assert cached_tokens(run)[1]["documents"] == len(docs) - 1
    second = cached_tokens(run)[1]["dir"]
    assert second != first and Path(first, "index.json").is_file()
    assert "built" in prepare_cache(compose(f"data.files={corpus}"), run)
    assert len(list(cache_dir.glob("*/index.json"))) == 3


@pytest.mark.parametrize(
    "case", ["vocab", "hf_model_vocab", "no_eos", "not_a_tokenizer", "not_jsonl", "mixed", "too_small"]
)
def test_more_bad_input(case, tmp_path, capsys, monkeypatch):
    """One line, exit 2, no run directory (also when the files are only found too small
    once tokenized, after the run directory was made)."""
    monkeypatch.chdir(tmp_path)
    corpus = write_jsonl(tmp_path / "c.jsonl", documents(30))
    overrides, words = [f"data.files={corpus}"], []
    if case == "vocab":
        big = make_tokenizer(tmp_path / "big", [f"w{i}" for i in range(300)])
        overrides += [f"data.tokenizer={big}"]
        words = ["data.tokenizer=", "302 tokens", "model.vocab_size=256"]
    elif case == "hf_model_vocab":  # model=hf: the embedding's rows come from its config.json
        from hf_models import tiny_llama_config

        overrides += ["model=hf", f"model.config={tiny_llama_config(tmp_path / 'llama', vocab_size=200)}"]
        words = ["data.tokenizer=byte", "256 tokens", "model.vocab_size=200"]
    elif case == "no_eos":
        tok = make_tokenizer(tmp_path / "tok", WORDS)
        config = json.loads((tok / "tokenizer_config.json").read_text())
        config.pop("eos_token", None)
        (tok / "tokenizer_config.json").write_text(json.dumps(config))
        overrides += [f"data.tokenizer={tok}"]
        words = ["data.tokenizer=", "no eos_token"]
    elif case == "not_a_tokenizer":
        (tmp_path / "empty").mkdir()
        overrides += [f"data.tokenizer={tmp_path / 'empty'}"]
        words = ["data.tokenizer=", "not a tokenizer AutoTokenizer loads offline"]
    elif case == "not_jsonl":
        (tmp_path / "bad.jsonl").write_text("[1, 2, 3]\n")
        overrides = [f"data.files={tmp_path / 'bad.jsonl'}"]
        words = ["bad.jsonl", "line 1 is not a JSON object"]
    elif case == "mixed":
        (tmp_path / "d.txt").write_text("text\n")
        overrides = [f"data.files=[{corpus},{tmp_path / 'd.txt'}]"]
        words = ["data.files=", "mixes formats (json, text)"]
    elif case == "too_small":
        overrides = [f"data.files={write_jsonl(tmp_path / 'tiny.jsonl', ['a b', 'c'])}"]
        words = ["data.files=", "hold 6 tokens", "train.seq_len=128 needs at least 129"]
    # Short, should a case ever get as far as training.
    code = cli.main(
        ["data=hf_text", *overrides, "train.steps=2", "optim.warmup_steps=0", f"hydra.run.dir={tmp_path / 'run'}"]
    )
    assert_refused(code, *capsys.readouterr(), words)
    assert not (tmp_path / "run").exists()
