"""The shared data cache is content-checked (issue 47, 4; launcher/data/shards.py): `make data`
(`launcher data`, run here as the user runs it) reuses an entry only when every file its
shard entries list is a plain name of its own whose digest matches; a token file whose size
is not a whole number of tokens is refused (issue 47, 5)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from corpus import documents, write_jsonl
from runs import assert_refused

from launcher.data.cache import read_tokens
from launcher.data.shards import memo_path
from launcher.launch import cli


@pytest.fixture
def made(tmp_path, monkeypatch, capsys):
    """`make data` of a small corpus into a cache of its own (this user's home: the memo)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LAUNCHER_DATA_CACHE", str(tmp_path / "cache"))
    corpus = write_jsonl(tmp_path / "c.jsonl", documents(300, seed=5))
    args = ["data", f"data.files={corpus}", "data.tokenizer=byte", "data.shard_mb=1"]
    assert cli.main(args) == 0
    entry = next(p for p in (tmp_path / "cache").iterdir() if (p / "index.json").is_file())
    capsys.readouterr()
    return args, entry, read_tokens(entry)[0]


def again(args, capsys) -> tuple[int, str, str]:
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_each_shard_file_has_a_digest_and_a_rewritten_shard_is_not_reused(made, capsys):
    """Another user rewrites a shard with other tokens of the same size: `make data` said
    "reused" and the run trained on them; now the entry is prepared again, to the same tokens."""
    args, entry, tokens = made
    index = json.loads((entry / "index.json").read_text())
    assert all(set(s["sha256"]) == {s["file"]} for s in index["shards"])
    assert again(args, capsys)[1].count("reused") == 1  # verified once, from the memo since
    shard = entry / index["shards"][0]["file"]
    shard.write_bytes(bytes(reversed(shard.read_bytes())))  # same size, other tokens
    code, out, _ = again(args, capsys)
    assert code == 0 and "reused" not in out and f"{shard.name} fails its sha256" in out, out
    assert np.array_equal(read_tokens(entry)[0], tokens)


def test_an_index_whose_digests_were_rewritten_with_its_shard_is_not_believed(made, capsys):
    """The same, with index.json's digest rewritten to match the forged shard: this user's
    memo of what it prepared does not agree."""
    args, entry, tokens = made
    index = json.loads((entry / "index.json").read_text())
    first = index["shards"][0]
    forged = bytes(reversed((entry / first["file"]).read_bytes()))
    (entry / first["file"]).write_bytes(forged)
    import hashlib

    first["sha256"][first["file"]] = hashlib.sha256(forged).hexdigest()
    (entry / "index.json").write_text(json.dumps(index))
    code, out, _ = again(args, capsys)
    assert code == 0 and "reused" not in out, out
    assert np.array_equal(read_tokens(entry)[0], tokens)
    assert memo_path().is_file()


@pytest.mark.parametrize("name", ["/etc/passwd", "../../other/shard_000000.bin", "link.bin"])
def test_a_shard_name_that_is_not_the_entrys_own_file_is_refused(name, made, capsys, tmp_path):
    args, entry, _ = made
    index = json.loads((entry / "index.json").read_text())
    if name == "link.bin":
        (entry / name).symlink_to(entry / index["shards"][0]["file"])
    index["shards"][0]["file"] = name
    (entry / "index.json").write_text(json.dumps(index))
    code, out, err = again(args, capsys)
    assert_refused(code, out, err, ["index.json names", name.split("/")[-1] if name == "link.bin" else repr(name)])


def test_an_entry_without_digests_is_prepared_again(made, capsys):
    """An entry an earlier version wrote (no digests): not believed, prepared again."""
    args, entry, tokens = made
    index = json.loads((entry / "index.json").read_text())
    for s in index["shards"]:
        del s["sha256"]
    (entry / "index.json").write_text(json.dumps(index))
    code, out, _ = again(args, capsys)
    assert code == 0 and "records no digest" in out and "reused" not in out, out
    assert np.array_equal(read_tokens(entry)[0], tokens)


@pytest.mark.parametrize("given", ["file", "folder", "glob", "mixture"])
def test_a_token_file_cut_mid_token_is_refused(given, tmp_path, capsys):
    """A uint16 token file of 1,000,001 bytes (a copy that stopped half-way) trained without
    a word; now refused in one line naming the file, its size and the dtype, however it is
    named: the file, a folder of shards, a glob, a mixture's source."""
    (tmp_path / "d").mkdir()
    good, cut = tmp_path / "d" / "a.bin", tmp_path / "d" / "b.bin"
    good.write_bytes(bytes(1_000_000))
    cut.write_bytes(bytes(1_000_001))
    path = {"file": str(cut), "folder": str(tmp_path / "d"), "glob": str(tmp_path / "d" / "*.bin"), "mixture": None}[
        given
    ]
    data = [f"data.path={path}"] if path else [f"data.sources='50 {good} 50 {cut}'"]
    code = cli.main(["train", "--dry-run", "data=memmap", *data])
    out, err = capsys.readouterr()
    assert_refused(code, out, err, [f"{cut} has 1,000,001 bytes, not a whole number of uint16 tokens"])


@pytest.mark.parametrize("folder", ["tokenizer", "model"])
def test_a_folder_that_asks_to_run_its_own_code_is_refused(folder, tmp_path, monkeypatch, capsys):
    """issue 47, 8: `auto_map` in a tokenizer folder made transformers ask "run the custom
    code? [y/N]" in the middle of a launch (a piped `y` ran it); in a model=hf config, the
    same. Refused in one line; nothing is read from stdin."""
    from corpus import make_tokenizer
    from hf_models import tiny_llama_config

    monkeypatch.setattr("sys.stdin", None)  # a prompt would fail on it
    monkeypatch.setenv("LAUNCHER_DATA_CACHE", str(tmp_path / "cache"))
    if folder == "tokenizer":
        path = make_tokenizer(tmp_path / "tok", ["a", "b"])
        config = path / "tokenizer_config.json"
        args = ["data", f"data.files={write_jsonl(tmp_path / 'c.jsonl', ['a b'])}", f"data.tokenizer={path}"]
    else:
        config = tiny_llama_config(tmp_path / "model")
        path = config.parent
        args = ["train", "--dry-run", "model=hf", f"model.config={path}"]
    raw = json.loads(config.read_text())
    raw["auto_map"] = (
        {"AutoTokenizer": ["evil.Tok", None]} if folder == "tokenizer" else {"AutoModelForCausalLM": "evil.Model"}
    )
    config.write_text(json.dumps(raw))
    (path / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    code = cli.main(args)
    out, err = capsys.readouterr()
    assert_refused(code, out, err, [f"{config} names custom code (auto_map", "trust_remote_code stays off"])
    assert not (tmp_path / "ran").exists()
