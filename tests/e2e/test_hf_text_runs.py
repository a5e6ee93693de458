"""data=hf_text, logger=tensorboard and the profiler: real files, real tokenizers (the byte
encoding and a tokenizer folder trained here with `tokenizers`), the data prepared by a
pool of processes into a shared cache, real launches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from corpus import WORDS, cached_tokens, documents, make_tokenizer, write_jsonl, write_parquet
from runs import assert_same_training, launch, read_metrics


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
    # Every metric logged (some, like the straggler's rank/*, not at every step), each at the steps it was logged.
    assert set(scalars) == {k for row in rows for k in row if k != "step"}
    for name, by_step in scalars.items():
        assert set(by_step) == {row["step"] for row in rows if name in row}, name
    for row in rows:
        for name, value in row.items():
            if name != "step":
                assert scalars[name][row["step"]] == value, (name, row["step"])  # exact: doubles


def profiled_steps(trace: Path) -> tuple[list[int], int]:
    """The train_step ranges in a trace, and how many aten::mm ran inside them (every
    aten::mm must: nothing outside the window is recorded)."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = {
        int(e["name"].split()[1]): (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and e.get("name", "").startswith("train_step ")
    }
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
    common = [
        "data=hf_text",
        f"data.files={corpus}/*.jsonl",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.steps=8",
        "optim.warmup_steps=2",
        "logger=tensorboard",
        "logger.log_every=1",
        "checkpoint.every=4",
        "train.seq_len=64",
        "profile.enabled=true",
        "profile.steps=[3,5]",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    first = launch(*common, run_dir=straight)
    assert "data: 400 documents" in first.stdout and "built" in first.stdout
    # Another run of the same data reads the same prepared directory, tokenized once.
    assert "reused" in launch(*common, "train.stop_at=4", run_dir=split).stdout
    again = launch(*common, run_dir=split)
    assert "reused" in again.stdout and "resumed from" in again.stdout and "at step 4" in again.stdout
    assert_same_training(straight, split, steps=8)
    for proc in (first, again):  # no C++ warning (c10's "[W<date> ...]"): the profiler used to log one per rank
        assert not re.search(r"\[W\d{4} ", proc.stdout + proc.stderr), proc.stdout + proc.stderr
    # Strict JSON (jq reads it): text has no known entropy floor, so the floor is null, not NaN.
    summary = json.loads((straight / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert summary["loss_floor"] is None and summary["final_loss"] > 0

    # The ranks read the prepared shards: the documents' bytes, each followed by EOS.
    tokens, meta = cached_tokens(straight)
    assert meta["tokens"] == sum(len(d.encode()) + 1 for d in docs) == len(tokens)
    assert bytes(tokens[: len(docs[0].encode())].astype(np.uint8)).decode() == docs[0]

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
    proc = launch(
        "recipe=fsdp",
        "data=hf_text",
        f"data.files={tmp_path}/pq/*.parquet",
        "data.text_field=body",
        f"data.tokenizer={tok_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.steps=10",
        "optim.warmup_steps=2",
        "train.seq_len=32",
        "logger=wandb",
        "logger.mode=offline",
        "logger.also=[tensorboard]",
        "logger.log_every=1",
        run_dir=run,
    )
    assert "data: 600 documents" in proc.stdout and "mesh:" in proc.stdout
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 11))
    # The tokenizer knows ~36 tokens: the loss falls from ln(256) = 5.5 as the model learns them.
    assert rows[0]["loss"] > 5.0 > rows[-1]["loss"] + 1.0, (rows[0]["loss"], rows[-1]["loss"])
    tokens, meta = cached_tokens(run)
    assert meta["source_format"] == "parquet" and meta["documents"] == 600 and int(tokens.max()) < meta["vocab_size"]
    assert_tensorboard_is_metrics(run)
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))
