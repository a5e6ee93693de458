"""Data: a synthetic Markov source (the default), memory-mapped token files and packed
chat windows; `micro_batch`, the one place a batch becomes what the engines get.

Every sample has a global index. The batch of optimizer step s is the global indices
[start + s*G, start + (s+1)*G) (G = global batch); data-parallel rank r takes its
contiguous slice and splits it into micro-batches. So the position in the data is one
number (`samples_seen`), a resume continues with the next unseen batch, and a resume at
another world size with the same global batch sees exactly the same data.

A sample is (seq_len + 1,) tokens, or (3, seq_len + 1): tokens, loss mask (1 where the token
counts as a target), positions (restarting at each sample or document with
data.document_masking, else 0..seq_len): data=chat's windows, and data=hf_text's with
data.document_masking. A batch is their stack.
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from launcher.config import Config, DataConfig, DataKind, TokenDtype, held_out_windows
from launcher.data import sources
from launcher.data.packing import Packed, restart_positions
from launcher.data.prepare import token_file_config

IGNORE = -100
"""A target no loss counts (torch's cross_entropy ignore_index, transformers' labels)."""


def micro_batch(batch: torch.Tensor, document_masking: bool = True) -> tuple[torch.Tensor, ...]:
    """A batch as the engines take it: (inputs, targets) of a (B, T + 1) batch; of a (B, 3,
    T + 1) one, targets IGNORE where the mask says the token does not count, and with
    `document_masking` (data.document_masking) the inputs' positions third."""
    if batch.dim() == 2:
        return batch[:, :-1], batch[:, 1:]
    tokens, mask, positions = batch[:, 0], batch[:, 1], batch[:, 2]
    targets = tokens[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE)
    return (tokens[:, :-1], targets, positions[:, :-1]) if document_masking else (tokens[:, :-1], targets)


class MarkovSource(Dataset):
    """An order-k Markov source over `vocab_size` tokens.

    The context is the previous token plus the low `context_bits` bits of each of the
    k-1 tokens before it; each context's next-token distribution is its own random
    permutation of one base distribution (p_i ∝ exp(-i / temperature)). A model first
    learns the bigram part, then to attend further back: a curve with a known floor.
    Because every context has the same entropy H(base), the source's entropy rate is
    exactly H(base), whatever the stationary distribution: a model that has learned the
    source reaches that loss and no lower.

    A sample is `seq_len + 1` tokens: the first k drawn uniformly, the rest from the chain,
    from a generator seeded by (seed, index): any sample is made anywhere, in any order.
    """

    def __init__(self, cfg: DataConfig, seq_len: int):
        self.vocab, self.order, self.seq_len = cfg.vocab_size, cfg.order, seq_len
        self.radix = 2**cfg.context_bits
        self.states = self.vocab * self.radix ** (self.order - 1)
        self.seed = cfg.seed
        rng = np.random.default_rng([cfg.seed, 0x5EED])
        base = np.exp(-np.arange(self.vocab) / cfg.temperature)
        self.base = base / base.sum()
        # token_of[s, r]: the token of rank r in context s (a random permutation per
        # context). Sampling a rank from `base`, then looking it up, samples the context's
        # distribution: p(v | s) = base[rank of v in s].
        self.token_of = np.argsort(rng.random((self.states, self.vocab)), axis=1).astype(np.int64)
        self.base_cdf = np.cumsum(self.base)
        self.base_cdf[-1] = 1.0

    # -------------------------------------------------------------------------- facts
    @property
    def entropy_rate(self) -> float:
        """Nats per token once the context is known."""
        p = self.base[self.base > 0]
        return float(-(p * np.log(p)).sum())

    def loss_floor(self, seq_len: int | None = None) -> float:
        """The best mean cross-entropy over one sample's targets: the first k-1 targets
        are uniform draws (ln V each), the rest follow the chain (entropy rate each)."""
        t = seq_len or self.seq_len
        uniform = min(self.order - 1, t)
        return (uniform * math.log(self.vocab) + (t - uniform) * self.entropy_rate) / t

    # -------------------------------------------------------------------------- sampling
    def _state(self, window: np.ndarray) -> np.ndarray:
        """window: (B, k) previous tokens, oldest first -> (B,) context ids."""
        state = window[:, -1].astype(np.int64)
        for j in range(2, self.order + 1):
            state = state * self.radix + (window[:, -j] % self.radix)
        return state

    def generate(self, indices: list[int]) -> np.ndarray:
        n, k = len(indices), self.order
        out = np.empty((n, self.seq_len + 1), dtype=np.int64)
        u = np.empty((n, self.seq_len + 1), dtype=np.float64)
        for row, idx in enumerate(indices):
            g = np.random.default_rng([self.seed, int(idx)])
            out[row, :k] = g.integers(0, self.vocab, size=min(k, self.seq_len + 1))
            u[row] = g.random(self.seq_len + 1)
        ranks = np.minimum(np.searchsorted(self.base_cdf, u, side="right"), self.vocab - 1)
        for t in range(k, self.seq_len + 1):
            out[:, t] = self.token_of[self._state(out[:, t - k : t]), ranks[:, t]]
        return out

    def prob(self, state: int, token: int) -> float:
        """p(token | context state)."""
        rank = int(np.nonzero(self.token_of[state] == token)[0][0])
        return float(self.base[rank])

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, idx: int) -> torch.Tensor:
        return torch.from_numpy(self.generate([idx])[0])

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        return torch.from_numpy(self.generate(indices))


class TokenFile(Dataset):
    """One token stream (launcher/data/sources.py: a flat uint16/uint32 file as nanoGPT's
    train.bin, a folder or glob of them, or a `make data` folder of shards). Sample i is a
    window of seq_len + 1 tokens: each file is cut into non-overlapping windows, and each
    epoch visits all of them in a fresh order seeded by (seed, `key`, epoch). A window is
    read from its file when needed (one positioned read; the page cache does the rest): no
    file stays open, whatever the number of shards and sources, and the dataset pickles
    small into loader workers."""

    def __init__(
        self, cfg: DataConfig, seq_len: int, seed: int, path: str | None = None, key: int = 0, eos_id: int | None = None
    ):
        where = path or cfg.path
        self.eos_id = eos_id  # data.document_masking: (3, T + 1) windows, positions restarting after each EOS
        self.stream = sources.stream("data.path", where, cfg.dtype)
        self.seq_len, self.seed, self.key = seq_len, seed, key
        per_file = self.stream.windows(seq_len)
        self.ends = np.cumsum(per_file)  # window w lies in the first file whose end exceeds it
        windows = int(self.ends[-1])
        # data.val_fraction: the last windows are validation's (held_out), never trained on
        self.held_out = held_out_windows(windows, cfg.val_fraction) if path is None else 0
        self.windows = windows - self.held_out
        if self.windows < 1:
            raise ValueError(
                f"{where}: {windows} window(s) of train.seq_len={seq_len} tokens, "
                f"{self.held_out} held out by data.val_fraction={cfg.val_fraction}: none left to train on"
            )

    def _window(self, idx: int) -> int:
        epoch, pos = divmod(int(idx), self.windows)
        return sources.permuted(pos, self.windows, sources.epoch_key(self.seed, self.key, epoch))

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, idx: int) -> torch.Tensor:
        return self.window(self._window(idx))

    def window(self, w: int) -> torch.Tensor:
        """Window w of the stream, in file order: its seq_len + 1 tokens."""
        f = int(np.searchsorted(self.ends, w, side="right"))
        start = (w - (int(self.ends[f - 1]) if f else 0)) * self.seq_len
        dtype = _np_dtype(self.stream.dtype)
        tokens = np.fromfile(self.stream.files[f], dtype=dtype, count=self.seq_len + 1, offset=start * dtype().itemsize)
        tokens = tokens.astype(np.int64)
        if self.eos_id is not None:
            positions = restart_positions(np.r_[True, tokens[:-1] == self.eos_id])
            tokens = np.stack([tokens, np.ones_like(tokens), positions])
        return torch.from_numpy(tokens)

    def fingerprint(self) -> str:
        """What decides the order: the order's kind, the windows trained and held out."""
        return f"feistel {self.windows}+{self.held_out} windows of {self.seq_len} in {len(self.stream.files)} file(s)"

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        return torch.stack([self[i] for i in indices])


class ChatFile(TokenFile):
    """data=chat: windows of whole samples (launcher/data/packing.py), each epoch in a fresh
    order as a token file's; the last data.val_fraction of them held out."""

    def __init__(self, folder: str, seq_len: int, seed: int, val_fraction: float, document_masking: bool):
        self.packed, self.document_masking = Packed(folder, seq_len + 1), document_masking
        self.seq_len, self.seed, self.key = seq_len, seed, 0
        self.held_out = held_out_windows(self.packed.windows, val_fraction)
        self.windows = self.packed.windows - self.held_out
        if self.windows < 1:
            raise ValueError(
                f"{folder}: {self.packed.windows} packed window(s), {self.held_out} held out by "
                f"data.val_fraction={val_fraction}: none left to train on"
            )

    def window(self, w: int) -> torch.Tensor:
        return torch.from_numpy(self.packed.window(w, self.document_masking))

    def fingerprint(self) -> str:
        return f"feistel {self.windows}+{self.held_out} packed windows of {self.seq_len} in {len(self.packed.files)} shard(s)"

    def real_tokens(self, first: int, last: int) -> int:
        """The tokens of samples (not padding) in global samples [first, last)."""
        idx = np.arange(first, last, dtype=np.int64)
        epochs, pos = np.divmod(idx, self.windows)
        total = 0
        for e in np.unique(epochs):
            w = sources.permuted_many(pos[epochs == e], self.windows, sources.epoch_key(self.seed, self.key, int(e)))
            total += int(self.packed.real[w].sum())
        return total


class Mixture(Dataset):
    """data.sources: global sample i goes to the source the blend gives its position
    (sources.blend), which serves its own k-th sample (its epochs in fresh orders)."""

    def __init__(self, cfg: Config, seed: int):
        self.sources = sources.sources(cfg.data)
        # a source with a validation file of its own holds out none of its windows
        self.streams = [
            TokenFile(
                dataclasses.replace(cfg.data, path=s.path, val_fraction=0.0 if s.val_path else cfg.data.val_fraction),
                cfg.train.seq_len,
                seed,
                key=zlib.crc32(s.name.encode()),
            )
            for s in self.sources
        ]
        self.which, self.rank, self.count = sources.blend([s.weight for s in self.sources])
        self.seq_len = cfg.train.seq_len

    def fingerprint(self) -> str:
        return "; ".join(f"{s.name} {s.weight:.6g}: {t.fingerprint()}" for s, t in zip(self.sources, self.streams))

    def locate(self, idx: int) -> tuple[int, int]:
        """(source, that source's own sample index) of global sample idx."""
        period, pos = divmod(int(idx), sources.BLEND_PERIOD)
        s = int(self.which[pos])
        return s, period * int(self.count[s]) + int(self.rank[pos])

    def consumed(self, samples: int) -> list[tuple[str, int, int, int]]:
        """(name, samples drawn, epoch now running, windows an epoch) of each source after `samples`."""
        drawn = sources.consumed(self.which, self.count, samples)
        return [(s.name, int(n), int(n) // t.windows, t.windows) for s, n, t in zip(self.sources, drawn, self.streams)]

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, idx: int) -> torch.Tensor:
        s, k = self.locate(idx)
        return self.streams[s][k]

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        return torch.stack([self[i] for i in indices])


class SourceMeter:
    """On log steps: each source's tokens drawn so far (data/<name>/tokens, a mixture's),
    and one console line when a source has been read to its end and starts a new epoch
    in a fresh order (any token stream)."""

    def __init__(self, dataset: Dataset, samples_seen: int, say):
        self.dataset, self.say = dataset, say
        self.mixed = isinstance(dataset, Mixture)
        self.epochs = {name: epoch for name, _, epoch, _ in self._drawn(samples_seen)}

    def _drawn(self, samples: int) -> list[tuple[str, int, int, int]]:
        """(name, samples drawn, epoch running, windows an epoch) per source."""
        if self.mixed:
            return self.dataset.consumed(samples)
        if isinstance(self.dataset, TokenFile):
            return [("data", samples, samples // self.dataset.windows, self.dataset.windows)]
        return []

    def metrics(self, step: int, samples_seen: int) -> dict:
        out = {}
        for name, drawn, epoch, windows in self._drawn(samples_seen):
            if epoch > self.epochs[name]:
                self.say(
                    f"data: {'source ' + name if self.mixed else 'the token data'} read to its end ({windows:,} "
                    f"sequences an epoch) by step {step}: epoch {epoch + 1} runs in a fresh order"
                )
                self.epochs[name] = epoch
            if self.mixed:
                out[f"data/{name}/tokens"] = drawn * self.dataset.seq_len
        return out


class Held(Dataset):
    """Validation samples: sample i is window `first + i % count` of a token file, in file
    order (the same windows every evaluation), or a synthetic source's sample 2**61 + i,
    an index training never reaches."""

    def __init__(self, source: Dataset, first: int = 0, count: int | None = None):
        self.source, self.first, self.count = source, first, count

    def __len__(self) -> int:
        return 2**62

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        if isinstance(self.source, MarkovSource):
            return self.source.__getitems__([2**61 + i for i in indices])
        return torch.stack([self.source.window(self.first + i % self.count) for i in indices])


def build_val_dataset(cfg: Config, train: Dataset, run_dir: Path | None = None) -> Dataset:
    """train.eval_every's held-out samples, beside the training set `train` (one stream)."""
    if isinstance(train, MarkovSource):
        return Held(train)
    return held_out_of(cfg, train, cfg.data.val_path)


def val_sets(cfg: Config, train: Dataset) -> list[tuple[str, float, Dataset]]:
    """(name, weight, held-out samples) to evaluate: one set, or one per source of a
    mixture (its own val_path, or its held-out windows), named for val/<name>/loss."""
    if isinstance(train, Mixture):
        return [(s.name, s.weight, held_out_of(cfg, t, s.val_path)) for s, t in zip(train.sources, train.streams)]
    return [("", 1.0, build_val_dataset(cfg, train))]


def held_out_of(cfg: Config, train: TokenFile, val_path: str | None) -> Held:
    if val_path:
        own = TokenFile(cfg.data, cfg.train.seq_len, cfg.train.seed, path=val_path)
        return Held(own, 0, own.windows)
    return Held(train, train.windows, train.held_out)


class StepSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches of global sample indices, step after step."""

    def __init__(self, start: int, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int):
        self.start, self.global_batch, self.micro_batch = start, global_batch, micro_batch
        per_rank = global_batch // dp_size
        self.offset = dp_rank * per_rank
        self.accum = per_rank // micro_batch

    def __iter__(self) -> Iterator[list[int]]:
        step = 0
        while True:
            base = self.start + step * self.global_batch + self.offset
            for m in range(self.accum):
                first = base + m * self.micro_batch
                yield list(range(first, first + self.micro_batch))
            step += 1


def _as_is(batch):
    return batch


def build_dataset(cfg: Config, run_dir: Path | None = None) -> Dataset:
    if cfg.data.name == DataKind.synthetic:
        return MarkovSource(cfg.data, cfg.train.seq_len)
    if cfg.data.name in (DataKind.hf_text, DataKind.chat):  # prepared by the launch side, in the shared cache
        d = token_file_config(cfg, run_dir)
        if cfg.data.name == DataKind.chat:
            return ChatFile(d.path, cfg.train.seq_len, cfg.train.seed, d.val_fraction, d.document_masking)
        eos = int(json.loads((Path(d.path) / sources.INDEX).read_text())["eos_id"]) if d.document_masking else None
        return TokenFile(d, cfg.train.seq_len, cfg.train.seed, eos_id=eos)
    if cfg.data.sources is not None:
        return Mixture(cfg, cfg.train.seed)
    return TokenFile(cfg.data, cfg.train.seq_len, cfg.train.seed)


def build_loader(
    cfg: Config, dataset: Dataset, start: int, global_batch: int, dp_rank: int, dp_size: int, device: torch.device
) -> DataLoader:
    workers = cfg.data.num_workers
    if workers is None:
        workers = 2 if device.type == "cuda" else 0
    sampler = StepSampler(start, global_batch, dp_rank, dp_size, cfg.train.micro_batch)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=_as_is,
        num_workers=workers,
        pin_memory=cfg.data.pin_memory and device.type == "cuda",
        prefetch_factor=cfg.data.prefetch_factor if workers > 0 else None,
        persistent_workers=workers > 0,
    )


def loss_floor(cfg: Config) -> float | None:
    """The data's entropy floor in nats per token, when it is known (synthetic data)."""
    if cfg.data.name == DataKind.synthetic:
        return MarkovSource(cfg.data, cfg.train.seq_len).loss_floor()
    return None


def write_tokens(tokens: np.ndarray, path: Path, dtype: TokenDtype = TokenDtype.uint16) -> None:
    """Write a flat token file that TokenFile reads (used by scripts/prepare_data.py)."""
    np.asarray(tokens, dtype=_np_dtype(dtype)).tofile(path)


def _np_dtype(dtype: TokenDtype):
    return np.uint16 if dtype == TokenDtype.uint16 else np.uint32
