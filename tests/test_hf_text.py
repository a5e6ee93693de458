"""data=hf_text, logger=tensorboard and the profiler: real `datasets`, real tokenizers
(the byte encoding and a tokenizer folder trained here with `tokenizers`), real launches."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import assert_same_training, launch, read_metrics
from launcher import cli
from launcher import config as C
from launcher.validate import validate
from launcher.hf_text import BYTE_EOS, POINTER, load_tokenizer, prepare_cache

WORDS = ("the quick brown fox jumps over a lazy dog while seven small ducks swim across the cold "
         "river and nobody sees them except an old owl sitting on a branch").split()


def documents(n: int, seed: int = 0) -> list[str]:
    r = random.Random(seed)
    docs = [" ".join(r.choice(WORDS) for _ in range(r.randint(4, 40))) for _ in range(n)]
    docs[1] = "naïve café, ünïcode — 日本語"  # more than one byte per character
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str]) -> Path:
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), path)
    return path


def make_tokenizer(folder: Path, words: list[str]) -> Path:
    """A word-level tokenizer folder, trained here (nothing downloaded), as a user's would be."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(str(folder))
    return folder


def compose(*overrides: str) -> C.Config:
    return cli.compose_config(["data=hf_text", *overrides])[0]


def cached_tokens(run_dir: Path) -> tuple[np.ndarray, dict]:
    meta = json.loads((run_dir / "data" / POINTER).read_text())
    dtype = np.uint16 if meta["dtype"] == "uint16" else np.uint32
    return np.fromfile(run_dir / "data" / meta["dir"] / "tokens.bin", dtype=dtype), meta


def test_every_format_gives_the_documents_bytes_and_eos(tmp_path):
    docs = documents(50)
    expected = np.concatenate([np.frombuffer(d.encode(), np.uint8).astype(np.int64).tolist() + [BYTE_EOS]
                               for d in docs])
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


def test_local_tokenizer_and_cache_key(tmp_path):
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

    # Same inputs: reused. A changed file, seq_len or tokenizer: rebuilt, the stale cache removed.
    assert "reused" in prepare_cache(cfg, run)
    write_jsonl(corpus, docs[:-1])
    line = prepare_cache(cfg, run)
    assert "built" in line and "inputs changed" in line
    assert cached_tokens(run)[1]["documents"] == len(docs) - 1
    second = cached_tokens(run)[1]["dir"]
    assert second != first and not (run / "data" / first).exists()
    assert "built" in prepare_cache(compose(f"data.files={corpus}", f"data.tokenizer={tok_dir}", "train.seq_len=64"), run)
    assert "built" in prepare_cache(compose(f"data.files={corpus}"), run)
    assert [p.name for p in (run / "data").iterdir() if p.name.startswith("hf_text-")] == [cached_tokens(run)[1]["dir"]]


@pytest.mark.parametrize("case", ["vocab", "hf_model_vocab", "no_eos", "not_a_tokenizer", "not_jsonl", "mixed", "too_small"])
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
    code = cli.main(["data=hf_text", *overrides, "train.steps=2", "optim.warmup_steps=0",
                     f"hydra.run.dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- launches
def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["tensors"]:
        for ev in acc.Tensors(tag):
            assert ev.step not in out.setdefault(tag, {}), f"{tag} logged twice at step {ev.step}"
            out[tag][ev.step] = tensor_util.make_ndarray(ev.tensor_proto).item()
    return out


def assert_tensorboard_is_metrics(run_dir: Path) -> None:
    rows = read_metrics(run_dir)
    scalars = tensorboard_scalars(run_dir)
    assert set(scalars) == {k for k in rows[0] if k != "step"}
    for row in rows:
        for name, value in row.items():
            if name != "step":
                assert scalars[name][row["step"]] == value, (name, row["step"])  # exact: doubles


def profiled_steps(trace: Path) -> tuple[list[int], int]:
    """The train_step ranges in a trace, and how many aten::mm ran inside them (every
    aten::mm must: nothing outside the window is recorded)."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = {int(e["name"].split()[1]): (e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("ph") == "X" and e.get("name", "").startswith("train_step ")}
    mms = [e for e in events if e.get("name") == "aten::mm"]
    inside = {s: sum(a <= e["ts"] <= b for e in mms) for s, (a, b) in spans.items()}
    assert all(inside.values()), inside  # every profiled step ran matmuls
    assert sum(inside.values()) == len(mms), "matmuls recorded outside the profiled steps"
    return sorted(spans), len(mms)


@pytest.mark.slow
def test_ddp_hf_text_resumes_bit_identically_with_tensorboard_and_profile(tmp_path):
    """ddp on JSON lines through the byte tokenizer, TensorBoard beside metrics.jsonl and a
    profile of steps 3..5: a run stopped after step 4 and resumed (inside the profile
    window) equals the uninterrupted one exactly."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = documents(400, seed=1)
    write_jsonl(corpus / "part0.jsonl", docs[:200])
    write_jsonl(corpus / "part1.jsonl", docs[200:])
    common = ["data=hf_text", f"data.files={corpus}/*.jsonl", "train.steps=8", "optim.warmup_steps=2",
              "logger=tensorboard", "logger.log_every=1", "checkpoint.every=4", "train.seq_len=64",
              "profile.enabled=true", "profile.steps=[3,5]"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    first = launch(*common, run_dir=straight)
    assert "data: 400 documents" in first.stdout and "built" in first.stdout
    launch(*common, "train.stop_at=4", run_dir=split)
    again = launch(*common, run_dir=split)
    assert "reused" in again.stdout and "resumed from" in again.stdout and "at step 4" in again.stdout
    assert_same_training(straight, split, steps=8)
    for proc in (first, again):  # no C++ warning (c10's "[W<date> ...]"): the profiler used to log one per rank
        assert not re.search(r"\[W\d{4} ", proc.stdout + proc.stderr), proc.stdout + proc.stderr
    # Strict JSON (jq reads it): text has no known entropy floor, so the floor is null, not NaN.
    summary = json.loads((straight / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert summary["loss_floor"] is None and summary["final_loss"] > 0

    # The ranks read the cache: its tokens are the documents' bytes, each followed by EOS.
    tokens, meta = cached_tokens(straight)
    assert meta["tokens"] == sum(len(d.encode()) + 1 for d in docs) == len(tokens)
    assert bytes(tokens[:len(docs[0].encode())].astype(np.uint8)).decode() == docs[0]

    for run in (straight, split):  # the resumed run's TensorBoard continues, each step once
        assert_tensorboard_is_metrics(run)
        assert sorted(tensorboard_scalars(run)["loss"]) == list(range(1, 9))

    # One trace per rank, the requested steps only. The resumed run's second launch
    # profiled the rest of the window (step 5); its first launch wrote steps 3..4 at stop_at.
    for rank in (0, 1):
        traces = list((straight / "profile").glob(f"rank{rank}.*.pt.trace.json"))
        assert len(traces) == 1, traces
        steps, mms = profiled_steps(traces[0])
        assert steps == [3, 4, 5] and mms > 0
        split_traces = sorted((split / "profile").glob(f"rank{rank}.*.pt.trace.json"))
        assert sorted(profiled_steps(t)[0] for t in split_traces) == [[3, 4], [5]]
    assert not list((straight / "profile").glob("memory_snapshot_*"))  # CUDA only


@pytest.mark.slow
def test_fsdp_hf_text_parquet_with_a_local_tokenizer(tmp_path):
    """A sharded recipe on parquet through a tokenizer folder, W&B and TensorBoard both."""
    docs = documents(600, seed=2)
    (tmp_path / "pq").mkdir()
    write_parquet(tmp_path / "pq" / "a.parquet", docs[:300])
    write_parquet(tmp_path / "pq" / "b.parquet", docs[300:])
    tok_dir = make_tokenizer(tmp_path / "tok", WORDS + docs[1].split())
    run = tmp_path / "run"
    proc = launch("recipe=fsdp", "data=hf_text", f"data.files={tmp_path}/pq/*.parquet", "data.text_field=body",
                  f"data.tokenizer={tok_dir}", "train.steps=10", "optim.warmup_steps=2", "train.seq_len=32",
                  "logger=wandb", "logger.mode=offline", "logger.also=[tensorboard]", "logger.log_every=1",
                  run_dir=run)
    assert "data: 600 documents" in proc.stdout and "mesh:" in proc.stdout
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 11))
    # The tokenizer knows ~36 tokens: the loss falls from ln(256) = 5.5 as the model learns them.
    assert rows[0]["loss"] > 5.0 > rows[-1]["loss"] + 1.0, (rows[0]["loss"], rows[-1]["loss"])
    tokens, meta = cached_tokens(run)
    assert meta["format"] == "parquet" and meta["documents"] == 600 and int(tokens.max()) < meta["vocab_size"]
    assert_tensorboard_is_metrics(run)
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))
