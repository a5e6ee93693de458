"""Launch-side checks of token data (data.path, data.sources) and of train.eval_every's
held-out data (each one line, exit 2, before any rank): that the files hold windows, where
the validation samples come from for each kind of data, and that there are some."""

from __future__ import annotations

from launcher.config import Config, ConfigError, DataKind, held_out_windows


def validate_token_data(cfg: Config) -> None:
    """data=memmap: data.path, or each source of data.sources (and its val_path)."""
    from launcher.data.sources import sources, windows_of  # local: start-up (numpy, 0.75 s, launch side)

    d, t = cfg.data, cfg.train
    if d.sources is None:
        if not d.path:
            raise ConfigError(
                "data.path",
                d.path,
                "missing: data=memmap needs a token file, a folder of shards or "
                "data.sources (scripts/prepare_data.py and make data make them)",
            )
        windows_of("data.path", d.path, d.dtype, t.seq_len)
        return
    if d.path is not None:
        raise ConfigError("data.path", d.path, "data.sources names the data already: use one of them (data.path=null)")
    if d.val_path is not None:
        raise ConfigError("data.val_path", d.val_path, "with data.sources each source names its own val_path")
    for s in sources(d):
        windows = windows_of(f"data.sources.{s.name}.path", s.path, d.dtype, t.seq_len)
        if s.val_path:
            windows_of(f"data.sources.{s.name}.val_path", s.val_path, d.dtype, t.seq_len)
        elif windows - held_out_windows(windows, d.val_fraction) < 1:
            raise ConfigError(
                "data.val_fraction", d.val_fraction, f"leaves source {s.name} no training window of its {windows}"
            )


def validate_held_out(cfg: Config) -> None:
    """data.val_path / data.val_fraction: for the data that can hold them out, and leaving training windows."""
    from launcher.data.sources import windows_of  # local: start-up (numpy, 0.75 s, launch side)

    t, d = cfg.train, cfg.data
    if not 0 <= d.val_fraction <= 0.5:
        raise ConfigError("data.val_fraction", d.val_fraction, "must be in [0, 0.5]")
    if d.val_path is not None and d.name != DataKind.memmap:
        raise ConfigError(
            "data.val_path",
            d.val_path,
            f"is for data=memmap (data={d.name.value}: "
            + ("held-out samples of its own source" if d.name == DataKind.synthetic else "data.val_fraction")
            + ")",
        )
    if d.val_fraction and d.name == DataKind.synthetic:
        raise ConfigError("data.val_fraction", d.val_fraction, "synthetic data holds out samples of its own (use 0)")
    if d.sources is not None and d.name != DataKind.memmap:
        raise ConfigError("data.sources", str(d.sources)[:80], f"is for data=memmap (data={d.name.value})")
    if d.val_path is not None and d.val_fraction:
        raise ConfigError(
            "data.val_fraction",
            d.val_fraction,
            "data.val_path names the held-out data already: use one of them (data.val_fraction=0)",
        )
    if d.val_path is not None:
        windows_of("data.val_path", d.val_path, d.dtype, t.seq_len)
    if d.val_fraction and d.name == DataKind.memmap and d.sources is None:  # data.path itself was checked before
        windows = windows_of("data.path", d.path, d.dtype, t.seq_len)
        if windows - held_out_windows(windows, d.val_fraction) < 1:
            raise ConfigError("data.val_fraction", d.val_fraction, f"leaves no training window of the file's {windows}")


def validate_evaluation(cfg: Config, dp: int, grad_accum: int) -> None:
    from launcher.data.sources import sources as sources_of  # local: start-up (numpy, 0.75 s, launch side)

    t, d = cfg.train, cfg.data
    if t.eval_every < 0:
        raise ConfigError("train.eval_every", t.eval_every, "must be >= 0 (0: never)")
    step = t.micro_batch * dp * (grad_accum if cfg.parallel.pp > 1 else 1)
    if t.eval_every and (t.eval_samples < 1 or t.eval_samples % step):
        raise ConfigError(
            "train.eval_samples",
            t.eval_samples,
            f"must be a positive multiple of micro_batch({t.micro_batch})"
            f" x data-parallel size({dp})"
            + (
                f" x grad_accum({grad_accum}): a pipeline evaluates a step's batch at a time"
                if cfg.parallel.pp > 1
                else ""
            )
            + f" = {step}",
        )
    validate_held_out(cfg)
    if t.eval_every and d.sources is not None and not d.val_fraction:
        lacking = [s.name for s in sources_of(d) if not s.val_path]
        if lacking:
            raise ConfigError(
                "train.eval_every",
                t.eval_every,
                f"source {lacking[0]} has no held-out data: a val_path "
                "in its entry, or data.val_fraction=0.01 for every source without one",
            )
    elif t.eval_every and d.name != DataKind.synthetic and d.val_path is None and not d.val_fraction:
        raise ConfigError(
            "train.eval_every",
            t.eval_every,
            f"data={d.name.value} needs held-out data: "
            + ("data.val_path=<token file> or " if d.name == DataKind.memmap else "")
            + "data.val_fraction=0.01",
        )
