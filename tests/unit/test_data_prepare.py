"""data=hf_text prepared by a pool of processes into the shared cache (launcher/data/cache.py,
units.py): work units over byte ranges and row groups, the same bytes from 1 process as
from 2, the content key and its reuse, a preparation killed with SIGKILL and continued, two
launches of one key, and `launcher data` (`make data`) end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from corpus import WORDS, documents, make_tokenizer, write_jsonl
from runs import assert_refused

from launcher import config as C
from launcher.data import cache, units
from launcher.data.cache import prepare, read_tokens
from launcher.data.inputs import BYTE_EOS, load_tokenizer
from launcher.launch import cli

REPO = Path(__file__).resolve().parents[2]
CONTRACT = {
    "format",
    "version",
    "dtype",
    "tokens",
    "documents",
    "shards",
    "tokenizer",
    "tokenizer_spec",
    "vocab_size",
    "eos_id",
    "text_field",
    "source_format",
    "sources",
}


def compose(*overrides: str) -> C.Config:
    return cli.compose_config(["data=hf_text", *overrides])[0]


def byte_tokens(docs: list[str]) -> np.ndarray:
    return np.concatenate([np.frombuffer(d.encode() + bytes([BYTE_EOS]), np.uint8) for d in docs if d]).astype(
        np.uint16
    )


def shard_bytes(folder: Path) -> list[bytes]:
    index = json.loads((folder / "index.json").read_text())
    return [(folder / s["file"]).read_bytes() for s in index["shards"]]


@pytest.fixture
def corpus(tmp_path) -> tuple[list[Path], list[str]]:
    """Three JSON-lines files: two small ones (one unit together) and a large one (cut)."""
    docs = documents(600, seed=3)
    docs[7] = ""  # an empty document adds nothing
    (tmp_path / "c").mkdir()
    files = [
        write_jsonl(tmp_path / "c" / "a.jsonl", docs[:20]),
        write_jsonl(tmp_path / "c" / "b.jsonl", docs[20:30]),
        write_jsonl(tmp_path / "c" / "c.jsonl", docs[30:]),
    ]
    return files, docs


# ----------------------------------------------------------------------------- units
def test_units_are_newline_aligned_pieces_in_order(corpus, tmp_path):
    files, _ = corpus
    plan = units.plan_units(files, C.TextFormat.json, 4096)
    pieces = [p for unit in plan for p in unit]
    assert len(plan) > 5 and {p["file"] for p in plan[0]} == {0, 1, 2}  # the small files share the first unit
    for i, f in enumerate(files):  # each file covered once, end to end, cut only after a newline
        own = [p for p in pieces if p["file"] == i]
        data = f.read_bytes()
        assert own[0]["start"] == 0 and own[-1]["end"] == len(data)
        assert all(a["end"] == b["start"] for a, b in zip(own, own[1:]))
        assert all(data[p["end"] - 1 : p["end"]] == b"\n" for p in own)
    assert all(sum(units.piece_bytes(p) for p in unit) < 4096 + 1024 for unit in plan)  # bounded: a line over at most

    pq.write_table(pa.table({"body": [f"row {i}" for i in range(1000)]}), tmp_path / "p.parquet", row_group_size=100)
    plan = units.plan_units([tmp_path / "p.parquet"], C.TextFormat.parquet, 1500)
    groups = [g for unit in plan for p in unit for g in p["row_groups"]]
    assert groups == list(range(10)) and 1 < len(plan) < 10


# ----------------------------------------------------------------------------- parallel = serial
@pytest.mark.parametrize("tokenizer", ["byte", "words"])
def test_two_processes_write_the_bytes_of_one(corpus, tmp_path, tokenizer):
    files, docs = corpus
    spec = "byte" if tokenizer == "byte" else str(make_tokenizer(tmp_path / "tok", WORDS + docs[1].split()))
    made = {}
    for n in (1, 2):
        cfg = compose(
            f"data.files={tmp_path}/c/*.jsonl",
            f"data.tokenizer={spec}",
            f"data.num_proc={n}",
            f"data.cache_dir={tmp_path / f'cache{n}'}",
        )
        got = prepare(cfg, unit_bytes=4096)
        assert not got.reused and got.processes == n and got.units > 5
        made[n] = got
    one, two = made[1], made[2]
    assert one.dir.name == two.dir.name  # the key: the contents, not where the cache is
    assert shard_bytes(one.dir) == shard_bytes(two.dir) and one.index == two.index
    tokens, index = read_tokens(two.dir)
    assert set(index) == CONTRACT and index["format"] == "launcher-tokens" and index["version"] == 1
    assert len(index["shards"]) == one.units and [s["file"] for s in index["shards"]][:2] == [
        "shard_000000.bin",
        "shard_000001.bin",
    ]
    assert index["documents"] == len(docs) - 1 == sum(s["documents"] for s in index["shards"])
    assert index["tokens"] == len(tokens) == sum(s["tokens"] for s in index["shards"])
    assert [s["path"] for s in index["sources"]] == [str(f) for f in files]
    if tokenizer == "byte":
        assert np.array_equal(tokens, byte_tokens(docs)) and index["eos_id"] == BYTE_EOS
    else:  # the documents in order, each followed by EOS
        hf = load_tokenizer(spec).tok
        eos = hf.convert_tokens_to_ids("<eos>")
        assert tokens.tolist() == [t for d in docs if d for t in hf(d, add_special_tokens=False)["input_ids"] + [eos]]
        assert index["tokenizer_spec"] == spec and index["eos_id"] == eos and index["dtype"] == "uint16"


def test_a_vocabulary_over_2_16_is_written_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(70000)}}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = tmp_path / "big"
    PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>", unk_token="<unk>").save_pretrained(str(tok))
    corpus = write_jsonl(tmp_path / "c.jsonl", ["w1 w69999 w5", "w42"])
    got = prepare(compose(f"data.files={corpus}", f"data.tokenizer={tok}", f"data.cache_dir={tmp_path / 'cache'}"))
    tokens, index = read_tokens(got.dir)
    assert index["dtype"] == "uint32" and index["vocab_size"] > 2**16 and int(tokens.max()) > 2**16


# ----------------------------------------------------------------------------- the key, reuse
def test_same_contents_are_reused_and_a_change_is_a_new_key(corpus, tmp_path):
    files, docs = corpus
    overrides = [f"data.files={tmp_path}/c/*.jsonl", f"data.cache_dir={tmp_path / 'cache'}"]
    first = prepare(compose(*overrides), unit_bytes=4096)
    stamps = {p.name: p.stat().st_mtime_ns for p in first.dir.iterdir()}
    assert sorted(stamps) == ["index.json"] + [f"shard_{k:06d}.bin" for k in range(first.units)]  # no record left
    memo = json.loads((tmp_path / "cache" / "digests.json").read_text())["files"]
    assert set(memo) == {str(f) for f in files}

    again = prepare(compose(*overrides, "train.seq_len=64", "data.shard_mb=1", "data.num_proc=1"))
    assert again.reused and again.dir == first.dir and "reused" in cache.describe(again)
    assert {p.name: p.stat().st_mtime_ns for p in first.dir.iterdir()} == stamps  # nothing written

    # The same bytes elsewhere (a copy, a touched file): the same key.
    (tmp_path / "copy").mkdir()
    for f in files:
        (tmp_path / "copy" / f.name).write_bytes(f.read_bytes())
    assert prepare(compose(f"data.files={tmp_path}/copy/*.jsonl", f"data.cache_dir={tmp_path / 'cache'}")).reused
    # Changed contents: another key, prepared beside the first.
    write_jsonl(files[1], docs[20:29])
    changed = prepare(compose(*overrides), unit_bytes=4096)
    assert not changed.reused and changed.dir != first.dir and (first.dir / "index.json").is_file()
    assert changed.index["documents"] == len(docs) - 2


def test_a_damaged_prepared_directory_is_prepared_again(corpus, tmp_path, capsys):
    """A shard purged from scratch space (or cut short): the next launch says so and makes
    it again, the same bytes, instead of starting ranks that fail on a missing file."""
    overrides = [f"data.files={tmp_path}/c/*.jsonl", f"data.cache_dir={tmp_path / 'cache'}"]
    first = prepare(compose(*overrides), unit_bytes=4096)
    before = shard_bytes(first.dir)
    (first.dir / first.index["shards"][1]["file"]).unlink()
    again = prepare(compose(*overrides), unit_bytes=4096)
    assert not again.reused and again.dir == first.dir and shard_bytes(again.dir) == before
    assert f"data: {first.dir} is damaged (" in capsys.readouterr().out


def test_a_lone_surrogate_becomes_a_replacement_character_not_a_refusal(tmp_path):
    """JSON allows "\\ud800", which no UTF-8 holds: that document's bad character becomes
    U+FFFD, as a decoder's errors="replace" does, and the preparation goes on."""
    corpus = tmp_path / "s.jsonl"
    corpus.write_text('{"text": "ok"}\n{"text": "a \\ud800 b"}\n')
    got = prepare(compose(f"data.files={corpus}", f"data.cache_dir={tmp_path / 'cache'}"))
    tokens, _ = read_tokens(got.dir)
    assert bytes(tokens.astype(np.uint8)) == b"ok\xff" + "a \ufffd b".encode() + b"\xff"


# ----------------------------------------------------------------------------- crashes, two launches
SLOW = """
import sys, time
from launcher.data import cache, units
from launcher.launch.compose import compose_config
real = units.tokenize_unit
def slow(job, report):  # every unit takes a while: time to kill the preparation in the middle
    time.sleep(float(sys.argv[2]))
    return real(job, report)
units.tokenize_unit = slow
cfg = compose_config(["data=hf_text", *sys.argv[3:]])[0]
print(cache.describe(cache.prepare(cfg, unit_bytes=int(sys.argv[1]))), flush=True)
"""


def slow_prepare(overrides: list[str], unit_bytes: int = 4096, delay: float = 0.3) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SLOW, str(unit_bytes), str(delay), *overrides],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_preparation_continues_to_the_same_bytes(corpus, tmp_path):
    overrides = [f"data.files={tmp_path}/c/*.jsonl", "data.num_proc=2"]
    reference = prepare(compose(*overrides, f"data.cache_dir={tmp_path / 'reference'}"), unit_bytes=4096)
    root = tmp_path / "cache"
    proc = slow_prepare([*overrides, f"data.cache_dir={root}"])
    folder = root / reference.dir.name
    wait_for(lambda: len(list(folder.glob("unit_*.json"))) >= 3, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers, mid-way
    proc.wait(timeout=30)
    recorded = len(list(folder.glob("unit_*.json")))
    assert not (folder / "index.json").exists() and 3 <= recorded < reference.units
    for record in folder.glob("unit_*.json"):  # a record's shard is whole
        r = json.loads(record.read_text())
        assert (folder / r["file"]).stat().st_size == 2 * r["tokens"]

    got = prepare(compose(*overrides, f"data.cache_dir={root}"), unit_bytes=4096)
    assert not got.reused and got.resumed >= recorded and f"of {got.units} units were done" in cache.describe(got)
    assert shard_bytes(got.dir) == shard_bytes(reference.dir) and got.index == reference.index
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("shard_")) == ["index.json"]


def test_a_second_launch_of_the_same_data_waits_and_reuses(corpus, tmp_path):
    overrides = [f"data.files={tmp_path}/c/*.jsonl", f"data.cache_dir={tmp_path / 'cache'}", "data.num_proc=1"]
    first = slow_prepare(overrides)
    wait_for(lambda: list((tmp_path / "cache").glob("*/plan.json")), first)  # it holds the lock
    second = subprocess.run(
        [sys.executable, "-m", "launcher", "data", *overrides], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    out_first, _ = first.communicate(timeout=120)
    assert first.returncode == 0 and "built" in out_first, out_first
    assert second.returncode == 0, second.stderr
    assert "waiting for it" in second.stdout and "reused" in second.stdout, second.stdout


# ----------------------------------------------------------------------------- make data
def test_make_data_end_to_end(tmp_path):
    docs = documents(12000, seed=5)  # about 1.5 MB: two units of data.shard_mb=1
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    argv = [
        sys.executable,
        "-m",
        "launcher",
        "data",
        f"data.files={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.shard_mb=1",
    ]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    shards = -(-corpus.stat().st_size // 2**20)
    assert (
        first.startswith("data: 12,000 documents, ") and f"(uint16, {shards} shards)" in first and "built in" in first
    )
    assert "\x1b[" not in proc.stdout  # not a terminal: no progress bar's escapes
    folder = Path(first.split("prepared data ", 1)[1].split(" built", 1)[0])
    assert folder.parent == tmp_path / "cache"
    tokens, index = read_tokens(folder)
    assert set(index) == CONTRACT and index["source_format"] == "json" and index["tokenizer"] == "byte"
    assert np.array_equal(tokens, byte_tokens(docs)) and index["tokens"] == len(tokens)
    assert index["sources"][0]["sha256"] == __import__("hashlib").sha256(corpus.read_bytes()).hexdigest()
    again = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and f"prepared data {folder} reused" in again.stdout

    make = subprocess.run(["make", "-n", "data", f"ARGS=data.files={corpus}"], cwd=REPO, capture_output=True, text=True)
    assert f".venv/bin/python -m launcher data data.files={corpus}" in make.stdout


@pytest.mark.parametrize("case", ["num_proc", "shard_mb", "not_hf_text", "not_text", "malformed"])
def test_bad_input_is_one_line_and_exit_2(case, corpus, tmp_path, capsys):
    files, _ = corpus
    overrides, words = [f"data.files={tmp_path}/c/*.jsonl", f"data.cache_dir={tmp_path / 'cache'}"], []
    if case == "num_proc":
        overrides.append("data.num_proc=0")
        words = ["data.num_proc=0", "must be >= 1"]
    elif case == "shard_mb":
        overrides.append("data.shard_mb=0")
        words = ["data.shard_mb=0", "must be >= 1"]
    elif case == "not_hf_text":
        overrides = ["data=memmap"]
        words = ["data=memmap", "prepares data=hf_text"]
    else:  # found by a worker, deep in a file
        lines = files[2].read_text().splitlines()
        lines[500] = '{"text": 5}' if case == "not_text" else '{"text": "cut'
        files[2].write_text("\n".join(lines) + "\n")
        words = (
            ["data.text_field=text", "c.jsonl holds a int in it, not text"]
            if case == "not_text"
            else ["data.files=", "c.jsonl", "cannot be read"]
        )
    code = cli.main(["data", *overrides])
    assert_refused(code, *capsys.readouterr(), words)
    assert not [p for p in tmp_path.glob("cache/*") if p.is_dir()]  # a file that cannot be read: nothing kept


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_elsewhere():
    import io

    from launcher.data.progress import Meter

    plain = io.StringIO()
    with Meter(2000, done=500, out=plain, every=0) as meter:
        meter.add(500, 10, 4000)
        meter.show()
    assert plain.getvalue().startswith("data: 50% of 2.0kB, ") and "documents/s" in plain.getvalue()
    assert "tokens/s, ETA " in plain.getvalue() and "\x1b[" not in plain.getvalue()
    quiet = io.StringIO()
    with Meter(2000, out=quiet) as meter:  # at most every PLAIN_EVERY seconds
        meter.add(500, 10, 4000)
        meter.show()
    assert quiet.getvalue() == ""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    with Meter(2000, out=tty) as meter:
        meter.add(1000, 10, 4000)
        meter.show()
        meter.bar.refresh()
    assert "50%" in tty.getvalue() and "tokens/s" in tty.getvalue() and "ETA" in tty.getvalue()
