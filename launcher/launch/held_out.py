"""Launch-side checks of train.eval_every's held-out data (each one line, exit 2, before
any rank): where the validation samples come from for each kind of data, and that there
are some."""

from __future__ import annotations

from pathlib import Path

from launcher.config import Config, ConfigError, DataKind, TokenDtype, held_out_windows


def token_windows(key: str, path: str, dtype: TokenDtype, seq_len: int) -> int:
    """A token file's windows of seq_len + 1 tokens (data.path, data.val_path alike);
    refused when the file is missing or shorter than one window."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key, path, "no such file")
    tokens = p.stat().st_size // dtype.width
    if tokens < seq_len + 1:
        raise ConfigError(key, path, f"holds {tokens} tokens; train.seq_len={seq_len} needs at least {seq_len + 1}")
    return (tokens - 1) // seq_len


def validate_evaluation(cfg: Config, dp: int, grad_accum: int) -> None:
    t, d = cfg.train, cfg.data
    if t.eval_every < 0:
        raise ConfigError("train.eval_every", t.eval_every, "must be >= 0 (0: never)")
    step = t.micro_batch * dp * (grad_accum if cfg.parallel.pp > 1 else 1)
    if t.eval_every and (t.eval_samples < 1 or t.eval_samples % step):
        raise ConfigError("train.eval_samples", t.eval_samples, f"must be a positive multiple of micro_batch({t.micro_batch})"
                          f" x data-parallel size({dp})" + (f" x grad_accum({grad_accum}): a pipeline evaluates a "
                          "step's batch at a time" if cfg.parallel.pp > 1 else "") + f" = {step}")
    if not 0 <= d.val_fraction <= 0.5:
        raise ConfigError("data.val_fraction", d.val_fraction, "must be in [0, 0.5]")
    if d.val_path is not None and d.name != DataKind.memmap:
        raise ConfigError("data.val_path", d.val_path, f"is for data=memmap (data={d.name.value}: "
                          + ("held-out samples of its own source" if d.name == DataKind.synthetic else "data.val_fraction") + ")")
    if d.val_fraction and d.name == DataKind.synthetic:
        raise ConfigError("data.val_fraction", d.val_fraction, "synthetic data holds out samples of its own (use 0)")
    if d.val_path is not None and d.val_fraction:
        raise ConfigError("data.val_fraction", d.val_fraction, "data.val_path names the held-out data already: "
                          "use one of them (data.val_fraction=0)")
    if d.val_path is not None:
        token_windows("data.val_path", d.val_path, d.dtype, t.seq_len)
    if d.val_fraction and d.name == DataKind.memmap:  # data.path itself was checked before
        windows = token_windows("data.path", d.path, d.dtype, t.seq_len)
        if windows - held_out_windows(windows, d.val_fraction) < 1:
            raise ConfigError("data.val_fraction", d.val_fraction, f"leaves no training window of the file's {windows}")
    if t.eval_every and d.name != DataKind.synthetic and d.val_path is None and not d.val_fraction:
        raise ConfigError("train.eval_every", t.eval_every, f"data={d.name.value} needs held-out data: "
                          + ("data.val_path=<token file> or " if d.name == DataKind.memmap else "") + "data.val_fraction=0.01")
