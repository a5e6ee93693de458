"""launcher.models.weights against real save_pretrained folders: every region it reads must
equal what safetensors' own loader gives, in one file, in shards with an index, in bf16,
through tiny chunks; bad files must be named (tensor and file) by index, check and read."""

from __future__ import annotations

import ast
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from launcher.models import weights as W
from launcher.models.weights import WeightsError


def _load(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors by safetensors' own loader (the reference)."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One tiny Llama saved three ways: one file, 20 KB shards with an index, bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    root = tmp_path_factory.mktemp("weights")
    model.save_pretrained(root / "single", safe_serialization=True)
    model.save_pretrained(root / "sharded", safe_serialization=True, max_shard_size="20KB")
    model.to(torch.bfloat16).save_pretrained(root / "bf16", safe_serialization=True)
    return {"single": root / "single", "sharded": root / "sharded", "bf16": root / "bf16"}


def _write(path: Path, header: dict, data: bytes = b"") -> Path:
    """A safetensors file by hand, for headers the library would never write."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_index_lists_every_tensor(folders):
    single, sharded = W.index(folders["single"]), W.index(folders["sharded"])
    assert (folders["sharded"] / "model.safetensors.index.json").is_file()
    assert len({e.file for e in sharded.values()}) > 2 and len({e.file for e in single.values()}) == 1
    ref = _load(folders["single"])
    assert set(single) == set(sharded) == set(ref) == set(W.index(folders["bf16"]))
    for name, t in ref.items():
        for e in (single[name], sharded[name]):
            assert (e.name, e.dtype, e.shape, e.end - e.start) == (name, t.dtype, tuple(t.shape), t.nbytes)
    assert {e.dtype for e in W.index(folders["bf16"]).values()} == {torch.bfloat16}


@pytest.mark.parametrize("kind", ["single", "sharded", "bf16"])
@pytest.mark.parametrize("chunk", [64, 16 << 20])
def test_whole_tensors(folders, kind, chunk):
    ref = _load(folders[kind])
    for name, e in W.index(folders[kind]).items():
        got = W.read(e, max_chunk_bytes=chunk)
        assert got.dtype == ref[name].dtype and torch.equal(got, ref[name]), name


BOXES = [
    ((3, 17), None),
    (None, (5, 29)),
    ((10, 40), (7, 8)),
    ((5, 5), None),
    (None, (5, 5)),
    ((63, 64), (31, 32)),
    ((0, 64), (0, 32)),
]


@pytest.mark.parametrize("kind", ["sharded", "bf16"])
@pytest.mark.parametrize("chunk", [1, 64, 16 << 20])
def test_boxes(folders, kind, chunk):
    entries, ref = W.index(folders[kind]), _load(folders[kind])
    name = "model.embed_tokens.weight"  # (64, 32)
    for rows, cols in BOXES:
        box = [rows or (0, 64), cols or (0, 32)]
        want = ref[name][box[0][0] : box[0][1], box[1][0] : box[1][1]]
        got = W.read(entries[name], box, max_chunk_bytes=chunk)
        assert got.shape == want.shape and torch.equal(got, want), box
    norm = "model.norm.weight"  # 1-D: a box on its only dimension
    assert torch.equal(W.read(entries[norm], [(3, 20)], max_chunk_bytes=chunk), ref[norm][3:20])
    up = "model.layers.1.mlp.up_proj.weight"  # (64, 32), in another shard
    assert torch.equal(W.read(entries[up], [(7, 50), (1, 31)], max_chunk_bytes=chunk), ref[up][7:50, 1:31])


@pytest.mark.parametrize("chunk", [64, 16 << 20])
def test_bf16_into_float32_out(folders, chunk):
    """The file's bf16 converted into a float32 `out`, contiguous or a transposed view."""
    e, want = W.index(folders["bf16"])["model.embed_tokens.weight"], _load(folders["bf16"])["model.embed_tokens.weight"]
    out = torch.full((20, 32), float("nan"))
    assert W.read(e, [(40, 60), (0, 32)], out=out, max_chunk_bytes=chunk) is out
    assert torch.equal(out, want[40:60].float())
    backing = torch.full((12, 30), float("nan"))  # out = backing.t(): (30, 12), not contiguous
    W.read(e, [(2, 32), (20, 32)], out=backing.t(), max_chunk_bytes=chunk)
    assert torch.equal(backing.t(), want[2:32, 20:32].float())


def test_into_same_dtype_out(folders):
    """float32 into float32: straight into out's storage, no buffer; a non-contiguous
    out of the same dtype goes through the buffer."""
    e, want = W.index(folders["single"])["lm_head.weight"], _load(folders["single"])["lm_head.weight"]
    out = torch.empty(30, 32)
    W.read(e, [(10, 40), (0, 32)], out=out)
    assert torch.equal(out, want[10:40])
    backing = torch.zeros(32, 64)
    W.read(e, None, out=backing.t())
    assert torch.equal(backing.t(), want)
    param = torch.nn.Parameter(torch.zeros(64, 32))
    W.read(e, None, out=param.data)
    assert torch.equal(param.detach(), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_into_cuda_out(folders):
    """Chunks copied into GPU memory, converted on the way, into a non-contiguous view too."""
    e, want = W.index(folders["bf16"])["model.embed_tokens.weight"], _load(folders["bf16"])["model.embed_tokens.weight"]
    out = torch.empty(40, 16, device="cuda")
    W.read(e, [(20, 60), (8, 24)], out=out, max_chunk_bytes=64)
    assert torch.equal(out.cpu(), want[20:60, 8:24].float())
    backing = torch.zeros(32, 64, dtype=torch.bfloat16, device="cuda")
    W.read(e, None, out=backing.t(), max_chunk_bytes=100)
    assert torch.equal(backing.t().cpu(), want)
    flat = torch.zeros(100, device="cuda", dtype=torch.float64)
    W.read_flat(e, 33, 133, out=flat, max_chunk_bytes=64)
    assert torch.equal(flat.cpu(), want.reshape(-1)[33:133].double())


@pytest.mark.parametrize("kind", ["single", "sharded", "bf16"])
@pytest.mark.parametrize("chunk", [2, 64, 16 << 20])
def test_read_flat(folders, kind, chunk):
    entries, ref = W.index(folders[kind]), _load(folders[kind])
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"):
        flat, e = ref[name].reshape(-1), entries[name]
        n = flat.numel()  # 2048, 512, 32 elements; rows of 32
        for a, b in [(0, n), (30, min(n, 70)), (31, min(n, 33)), (5, 5), (n - 1, n), (0, 1), (n // 3, n // 2 + 1)]:
            got = W.read_flat(e, a, b, max_chunk_bytes=chunk)
            assert got.dtype == flat.dtype and torch.equal(got, flat[a:b]), (name, a, b)
            out = torch.empty(b - a, dtype=torch.float32)
            assert W.read_flat(e, a, b, out=out, max_chunk_bytes=chunk) is out
            assert torch.equal(out, flat[a:b].float())


def test_every_dtype_and_zero_dim(tmp_path):
    tensors = {
        "f64": torch.randn(3, 4, dtype=torch.float64),
        "f16": torch.randn(5, 2).half(),
        "i64": torch.arange(-12, 12).view(2, 3, 4),
        "i32": torch.arange(7, dtype=torch.int32),
        "i16": torch.arange(6, dtype=torch.int16).view(3, 2),
        "i8": torch.arange(-4, 4, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([[True, False], [False, True]]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    entries = W.index(tmp_path)
    for name, t in tensors.items():
        assert torch.equal(W.read(entries[name], max_chunk_bytes=1), t), name
        assert torch.equal(W.read_flat(entries[name], 0, t.numel()), t.reshape(-1)), name
    assert W.read(entries["scalar"]).shape == ()
    out = torch.zeros((), dtype=torch.float64)
    W.read(entries["scalar"], [], out=out)
    assert out.item() == 3.5
    assert torch.equal(W.read(entries["i64"], [(1, 2), (0, 3), (1, 3)]), tensors["i64"][1:2, :, 1:3])


def test_truncated_file_named_by_index(folders, tmp_path):
    folder = shutil.copytree(folders["sharded"], tmp_path / "copy")
    before = W.index(folder)
    path = max({e.file for e in before.values()})
    cut = path.stat().st_size - 100
    os.truncate(folder / path.name, cut)
    first = min((e for e in before.values() if e.file == path and e.end > cut), key=lambda e: e.start)
    with pytest.raises(WeightsError) as err:
        W.index(folder)
    assert (err.value.tensor, err.value.file) == (first.name, folder / path.name)
    assert str(err.value).startswith(f"{first.name} in {folder / path.name}: truncated")


def test_truncated_after_index_reads_only_its_rows(folders, tmp_path):
    """Rows before the cut still read (only their bytes are read); the rest is a short read."""
    shutil.copy(folders["single"] / "model.safetensors", tmp_path)
    entries, ref = W.index(tmp_path), _load(folders["single"])
    last = max(entries.values(), key=lambda e: e.end)
    row = last.shape[1] * 4 if len(last.shape) == 2 else 4
    os.truncate(tmp_path / "model.safetensors", last.end - 3 * row)
    assert torch.equal(W.read(last, [(0, 2)] + [(0, s) for s in last.shape[1:]]), ref[last.name][:2])
    n = last.shape[0] * (last.shape[1] if len(last.shape) == 2 else 1)
    for call in (
        lambda: W.read(last),  # straight into a new tensor
        lambda: W.read_flat(last, 0, n, out=torch.empty(n, dtype=torch.float64)),
    ):  # through the buffer
        with pytest.raises(WeightsError, match="short read") as err:
            call()
        assert (err.value.tensor, err.value.file) == (last.name, tmp_path / "model.safetensors")
        assert str(err.value).startswith(f"{last.name} in {tmp_path / 'model.safetensors'}: ")


def test_check(folders):
    folder = folders["sharded"]
    entries = W.index(folder)
    expected = {name: e.shape for name, e in entries.items()}
    W.check(entries, expected)
    up, norm = "model.layers.0.mlp.up_proj.weight", "model.norm.weight"
    missing = {k: v for k, v in entries.items() if k != up}
    with pytest.raises(WeightsError) as err:
        W.check(missing, expected)
    assert str(err.value) == f"{up}: missing from {folder} (the folder's *.safetensors hold {len(missing)} tensors)"
    assert (err.value.tensor, err.value.file) == (up, folder)
    extra = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    with pytest.raises(WeightsError) as err:
        W.check(entries, extra)
    assert str(err.value) == f"lm_head.weight in {entries['lm_head.weight'].file}: not a parameter of the model"
    W.check(entries, extra, ignore=["lm_head.weight"])
    with pytest.raises(WeightsError) as err:
        W.check(entries, {**expected, norm: (64,)})
    assert str(err.value) == f"{norm} in {entries[norm].file}: shape (32,) where the model has (64,)"
    with pytest.raises(WeightsError, match=r"^lm_head\.weight in "):  # the first problem in name order
        W.check(missing, {**extra, norm: (64,)})


def test_bad_headers(tmp_path):
    def fails(header_or_bytes, match: str, data: bytes = b"", tensor: str | None = None):
        folder = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        path = folder / "model.safetensors"
        if isinstance(header_or_bytes, bytes):
            path.write_bytes(header_or_bytes)
        else:
            _write(path, header_or_bytes, data)
        with pytest.raises(WeightsError, match=match) as err:
            W.index(folder)
        assert (err.value.tensor, err.value.file) == (tensor, path) and str(path) in str(err.value)

    fails(b"\x05\x00", "too short")
    fails(struct.pack("<Q", 1 << 40) + b"{}", "header length")
    fails(struct.pack("<Q", 9) + b"not json!", "not JSON")
    fails(struct.pack("<Q", 2) + b"[]", "not a JSON object")
    fails({"a": {"dtype": "F32", "shape": [2]}}, "garbled header entry", b"\0" * 8, tensor="a")
    fails({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "garbled header entry", b"\0" * 8, "a")
    fails({"a": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}, "dtype C64 not handled", b"\0" * 16, "a")
    fails(
        {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
        r"hold 8 bytes where F32 \(3,\) needs 12",
        b"\0" * 8,
        "a",
    )
    fails(
        {
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        },
        "truncated",
        b"\0" * 12,
        "b",
    )


def test_bad_folders(tmp_path):
    one = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    _write(tmp_path / "x.safetensors", one, b"\0" * 4)
    _write(tmp_path / "y.safetensors", one, b"\0" * 4)
    with pytest.raises(WeightsError, match=r"^a in .*y\.safetensors: also in .*x\.safetensors"):
        W.index(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x.safetensors"}}))
    assert W.index(tmp_path)["a"].file == tmp_path / "x.safetensors"  # the index decides: y is not read
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "z.safetensors"}}))
    with pytest.raises(WeightsError, match=r"^a in .*index\.json: its file 'z\.safetensors' is not"):
        W.index(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(WeightsError, match="garbled"):
        W.index(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match=r"empty: no \*\.safetensors weights"):
        W.index(tmp_path / "empty")
    with pytest.raises(WeightsError, match="no such folder"):
        W.index(tmp_path / "nowhere")


def test_reads_without_the_libraries():
    """The ranks need neither transformers nor safetensors, and never mmap or unpickle."""
    tree = ast.parse(Path(W.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"transformers", "safetensors", "mmap", "pickle", "numpy"}, imported
