"""Token streams and mixtures (launcher/data/sources.py, read.py): a folder, a glob or an
index of shards read as one stream, windows never spanning two files, files mapped only
when read; a weighted mixture that is a pure function of the seed and the global sample
index, whose shares match the weights, and whose sources run out into fresh epochs."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from launcher.config import Config, ConfigError, DataConfig, TokenDtype
from launcher.data import sources
from launcher.data.read import Mixture, SourceMeter, TokenFile, val_sets

SEQ = 8


def shard(path: Path, first: int, tokens: int, dtype=np.uint16) -> Path:
    """A flat token file whose tokens count up from `first`: a window's first token says
    which file and where it came from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.arange(first, first + tokens, dtype=dtype).tofile(path)
    return path


def config(**data) -> Config:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), {"train": {"seq_len": SEQ}}))
    cfg.data = DataConfig(name="memmap", **data)
    return cfg


def test_a_folder_a_glob_and_an_index_of_shards_are_one_stream(tmp_path):
    # 3 shards of 20, 9 and 33 tokens: (20-1)//8 = 2, (9-1)//8 = 1, (33-1)//8 = 4 windows
    files = [shard(tmp_path / "s" / f"part_{i}.bin", 1000 * i, n) for i, n in enumerate((20, 9, 33))]
    folder = TokenFile(DataConfig(name="memmap", path=str(tmp_path / "s")), SEQ, seed=0)
    globbed = TokenFile(DataConfig(name="memmap", path=str(tmp_path / "s" / "part_*.bin")), SEQ, seed=0)
    (tmp_path / "s" / "index.json").write_text(
        json.dumps(
            {
                "format": "launcher-tokens",
                "version": 1,
                "dtype": "uint16",
                "tokens": 62,
                "documents": 3,
                "shards": [{"file": f.name, "tokens": n, "documents": 1} for f, n in zip(files, (20, 9, 33))],
            }
        )
    )
    indexed = TokenFile(DataConfig(name="memmap", path=str(tmp_path / "s"), dtype=TokenDtype.uint32), SEQ, seed=0)
    assert folder.windows == globbed.windows == indexed.windows == 7  # the index's dtype wins over data.dtype
    starts = [int(folder.window(w)[0]) for w in range(7)]
    assert starts == [0, 8, 1000, 2000, 2008, 2016, 2024]  # no window spans two files
    for w in range(7):  # each window is seq_len + 1 consecutive tokens of one file
        x = folder.window(w).numpy()
        assert (
            (np.diff(x) == 1).all()
            and (x == indexed.window(w).numpy()).all()
            and (x == globbed.window(w).numpy()).all()
        )
    epoch = sorted(int(folder[i][0]) for i in range(7))
    assert epoch == sorted(starts)  # an epoch visits every window once
    assert [int(folder[i][0]) for i in range(7, 14)] != [int(folder[i][0]) for i in range(7)]  # a fresh order


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_ten_thousand_shards_cost_a_stat_each_and_keep_no_file_open(tmp_path):
    for i in range(10_000):
        shard(tmp_path / "many" / f"{i:05d}.bin", 10 * i, SEQ + 1, dtype=np.uint32)
    before = open_files()
    ds = TokenFile(DataConfig(name="memmap", path=str(tmp_path / "many"), dtype=TokenDtype.uint32), SEQ, seed=0)
    assert ds.windows == 10_000
    got = ds.__getitems__(list(range(500)))
    assert {int(x[0]) % 10 for x in got} == {0} and len({int(x[0]) for x in got}) == 500  # 500 shards' windows
    assert open_files() == before  # whatever the shards and sources: no descriptor kept
    assert len(pickle.dumps(ds)) < 2_000_000  # into a loader worker: the file list, no mapped bytes


def test_a_glob_takes_token_files_only_and_never_a_prepared_folders_shards(tmp_path):
    shard(tmp_path / "flat" / "a.bin", 0, 17)
    (tmp_path / "flat" / "notes.txt").write_text("not tokens")
    assert TokenFile(DataConfig(name="memmap", path=str(tmp_path / "flat" / "*")), SEQ, seed=0).stream.files == (
        str(tmp_path / "flat" / "a.bin"),
    )
    shard(tmp_path / "prep" / "shard_000000.bin", 0, 17)
    (tmp_path / "prep" / "index.json").write_text(
        json.dumps(
            {"format": "launcher-tokens", "dtype": "uint32", "shards": [{"file": "shard_000000.bin", "tokens": 8}]}
        )
    )
    with pytest.raises(ConfigError, match="a shard of the prepared folder"):
        sources.stream("data.path", str(tmp_path / "prep" / "*.bin"), TokenDtype.uint16)


@pytest.mark.parametrize(
    "index,words",
    [
        ("{not json", "Expecting property name"),
        ('{"format": "launcher-tokens", "dtype": "uint16"}', "has no 'shards'"),
        ('{"format": "launcher-tokens", "dtype": "int7", "shards": []}', "int7"),
        (
            '{"format": "launcher-tokens", "dtype": "uint16", "shards": [{"file": "s.bin", "tokens": 99}]}',
            "names s.bin with 99 tokens; it holds 17",
        ),
        (
            '{"format": "launcher-tokens", "dtype": "uint16", "shards": [{"file": "gone.bin", "tokens": 9}]}',
            "it is missing",
        ),
    ],
)
def test_a_broken_index_is_one_line(index, words, tmp_path):
    shard(tmp_path / "p" / "s.bin", 0, 17)
    (tmp_path / "p" / "index.json").write_text(index)
    with pytest.raises(ConfigError, match=words):
        sources.stream("data.path", str(tmp_path / "p"), TokenDtype.uint16)


def test_the_epoch_order_is_a_permutation_at_any_size():
    for n in (1, 2, 3, 7, 64, 1000, 4097):
        assert sorted(sources.permuted(i, n, 99) for i in range(n)) == list(range(n))
    a = [sources.permuted(i, 10**9, sources.epoch_key(1, 2, 3)) for i in range(5)]
    assert a == [sources.permuted(i, 10**9, sources.epoch_key(1, 2, 3)) for i in range(5)]  # a pure function
    assert a != [sources.permuted(i, 10**9, sources.epoch_key(1, 2, 4)) for i in range(5)]  # each epoch its own


def mixture(tmp_path, weights=(0.69, 0.31), sizes=(800, 160), **more) -> Mixture:
    for name, n, first in zip("ab", sizes, (0, 30000)):
        shard(tmp_path / f"{name}.bin", first, n * SEQ + 1)
    entries = [{"name": name, "path": str(tmp_path / f"{name}.bin"), "weight": w} for name, w in zip("ab", weights)]
    return Mixture(config(sources=entries, **more), seed=0)


def source_of(sample) -> str:
    return "a" if int(sample[0]) < 30000 else "b"


def test_the_blend_matches_the_weights_and_is_a_function_of_the_global_index(tmp_path):
    mix = mixture(tmp_path)
    drawn = [source_of(mix[i]) for i in range(300)]
    assert abs(drawn.count("a") / 300 - 0.69) < 0.02 and abs(drawn.count("b") / 300 - 0.31) < 0.02
    for n in (1, 50, 299, 300):  # every prefix within one sample of its share
        assert abs(drawn[:n].count("b") - 0.31 * n) <= 1
    late = [70_000, 123_456, 5]  # any index, in any order, in another process: the same sample
    script = (
        "import sys; sys.path.insert(0, {t!r}); from test_data_sources import mixture; from pathlib import Path; "
        "m = mixture(Path({d!r})); print([m[i].tolist()[:3] for i in {late!r}])"
    ).format(t=str(Path(__file__).parent), d=str(tmp_path), late=late)
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str([mix[i].tolist()[:3] for i in late])
    assert [name for name, *_ in mix.consumed(300)] == ["a", "b"]
    assert [n for _, n, *_ in mix.consumed(300)] == [drawn.count("a"), drawn.count("b")]


def test_a_source_that_runs_out_starts_a_fresh_epoch_and_says_so(tmp_path):
    mix = mixture(tmp_path, sizes=(800, 20))
    b = [int(mix[i][0]) for i in range(200) if source_of(mix[i]) == "b"]  # 62 of b's samples: 3 epochs and more
    first, second = b[:20], b[20:40]
    assert sorted(first) == sorted(second) and first != second  # all its windows again, another order
    said = []
    meter = SourceMeter(mix, 0, said.append)
    metrics = meter.metrics(step=10, samples_seen=40)
    assert metrics == {
        "data/a/tokens": (40 - [n for _, n, *_ in mix.consumed(40)][1]) * SEQ,
        "data/b/tokens": mix.consumed(40)[1][1] * SEQ,
    }
    assert said == []
    meter.metrics(step=20, samples_seen=70)  # b: 0.31 x 70 = 21.7 > 20 windows
    assert said == ["data: source b read to its end (20 sequences an epoch) by step 20: epoch 2 runs in a fresh order"]


def test_each_source_holds_out_its_own_windows_for_validation(tmp_path):
    mix = mixture(tmp_path, val_fraction=0.1)
    assert [t.held_out for t in mix.streams] == [80, 16]
    sets = val_sets(config(val_fraction=0.1), mix)
    assert [(name, weight) for name, weight, _ in sets] == [("a", 0.69), ("b", 0.31)]  # val/a/loss, val/b/loss
    trained = {int(mix[i][0]) for i in range(3000)}
    for (name, _, held), stream, (first, last) in zip(sets, mix.streams, [(720, 800), (144, 160)]):
        windows = {int(stream.window(w)[0]) for w in range(first, last)}
        val = {int(x[0]) for x in held.__getitems__(list(range(100)))}
        assert val == windows, name  # its held-out windows, all of them, in every evaluation
        assert not trained & windows  # never trained on


def test_the_megatron_form_and_bad_sources():
    parsed = sources.sources(DataConfig(name="memmap", sources="30 /d/web.bin 70 /d/code.v2/"))
    assert [(s.name, s.path, s.weight) for s in parsed] == [("web", "/d/web.bin", 0.3), ("code.v2", "/d/code.v2/", 0.7)]
    for bad, words in [
        ("30 a.bin 70", "pairs of weight and path"),
        ([{"path": "a.bin", "weight": 0}], "weight must be a number > 0"),
        ([{"path": "x/a.bin", "weight": 1}, {"path": "y/a.bin", "weight": 1}], "share this name"),
        ([{"path": "a.bin", "weight": 1, "colour": "red"}], "{name, path, weight}"),
        ([{"name": "a b", "path": "a.bin", "weight": 1}], "letters, digits"),
        ("99999 a.bin 1 b.bin", "below the blend's resolution"),
    ]:
        with pytest.raises(ConfigError, match=words.replace("{", r"\{").replace("}", r"\}")):
            sources.sources(DataConfig(name="memmap", sources=bad))
