"""Metrics: measured on every rank, written by global rank 0 only, through one helper.

Sinks: the console (a progress bar on a terminal, one line per log step otherwise, a
summary table at the end), RUN_DIR/metrics.jsonl, and the sinks logger.name and
logger.also choose: Weights & Biases (one run per job, offline files in RUN_DIR/wandb
when there is no API key, the same run id on resume) and TensorBoard (event files in
RUN_DIR/tensorboard, scalars in double precision under the same names).
"""

from __future__ import annotations

import configparser
import contextlib
import json
import math
import os
import secrets
import socket
import string
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from launcher import jsonout, provenance
from launcher.config import Config, LoggerKind, WandbMode, to_dict

# The names users, dashboards and tests rely on. Keep them stable. `mfu` joins them where
# the device's peak is known (launcher/device.py::peak_flops), never above 1.
STEP_METRICS = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "step_time_s",
    "tokens_per_s",
    "samples_per_s",
    "data_wait_frac",
    "mem/peak_bytes",
    "mem/reserved_bytes",
    "mem/params_bytes",
    "mem/grads_bytes",
    "mem/optim_bytes",
    "mem/model_state_bytes",
    "mem/host_bytes",
)


@dataclass
class Throughput:
    """Accumulates time between log steps; gives the rates for one log interval."""

    tokens_per_step: int
    samples_per_step: int
    flops_per_token: float
    peak_flops_total: float | None
    """Peak FLOP/s of one device times the number of devices; None where no peak is known
    (a CPU without cluster.peak_tflops, a GPU not in the table): no `mfu` then."""
    steps: int = 0
    data_wait: float = 0.0
    start: float = field(default_factory=time.perf_counter)

    def rates(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        step_time = elapsed / max(self.steps, 1)
        tokens_per_s = self.tokens_per_step / step_time
        out = {
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": self.samples_per_step / step_time,
            "data_wait_frac": min(1.0, self.data_wait / elapsed),
        }
        mfu = tokens_per_s * self.flops_per_token / self.peak_flops_total if self.peak_flops_total else None
        if mfu is not None and mfu <= 1.0:  # above: the peak given is not the device's; no figure is better
            out["mfu"] = mfu
        self.steps, self.data_wait, self.start = 0, 0.0, time.perf_counter()
        return out


class PackMeter:
    """data=chat, at log steps, over the interval since the last one (all ranks):
    data/tokens_seen (input tokens of the windows), data/tokens_trained (targets the loss
    counted: counted on the host from each batch before it goes to the device, summed
    over ranks on the CPU group) and data/packing_efficiency (sample tokens over window
    tokens, from the windows' table)."""

    def __init__(self, dataset, samples_seen: int, replicas: int, group):
        self.on = hasattr(dataset, "packed")  # launcher/data/read.py's ChatFile
        self.dataset, self.seen, self.replicas, self.group, self.counted = dataset, samples_seen, replicas, group, 0
        self.this_step = 0

    def count(self, batch) -> None:
        if self.on:
            n = int(batch[:, 1, 1:].count_nonzero())
            self.counted += n
            self.this_step += n

    def step_counted(self) -> int | None:
        """The counted targets of this step's batches over every data-parallel rank (one
        all-reduce of a number on the CPU group a step; data=chat only, else None): what
        the step's losses divide by (launcher/models/gpt.py::COUNTED)."""
        if not self.on:
            return None
        import torch  # local: torch (launch side: cli.py imports this module to check W&B)
        import torch.distributed as dist  # local: torch (launch side: cli.py imports this module to check W&B)

        total = torch.tensor([self.this_step], dtype=torch.int64)
        dist.all_reduce(total, group=self.group)
        self.this_step = 0
        return max(1, int(total) // self.replicas)

    def metrics(self, samples_seen: int) -> dict:
        if not self.on or samples_seen == self.seen:
            return {}
        import torch  # local: torch (launch side: cli.py imports this module to check W&B)
        import torch.distributed as dist  # local: torch (launch side: cli.py imports this module to check W&B)

        counted = torch.tensor([self.counted], dtype=torch.int64)
        dist.all_reduce(counted, group=self.group)  # every rank logs at the same steps
        n, size = samples_seen - self.seen, self.dataset.seq_len
        out = {
            "data/tokens_seen": n * size,
            "data/tokens_trained": int(counted) // self.replicas,
            "data/packing_efficiency": self.dataset.real_tokens(self.seen, samples_seen) / (n * (size + 1)),
        }
        self.seen, self.counted = samples_seen, 0
        return out


def keep_rows_up_to(path: Path, step: int) -> None:
    """metrics.jsonl as the run resumes at `step`: the rows of steps after it (logged by a
    launch that died before its next checkpoint, to be logged again) and a row cut short
    (a full disk, a kill mid-write) go, so every step appears once, whole. Rewritten
    atomically, only when something goes."""
    try:
        text = path.read_text()
    except OSError:
        return
    kept = []
    for line in text.splitlines(keepends=True):
        try:
            row = json.loads(line) if line.endswith("\n") else None
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line)
    if len(kept) == len(text.splitlines()) and text.endswith("\n") or not text:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class RankZeroLogger:
    """Every rank holds one; only global rank 0's writes anything."""

    def __init__(self, cfg: Config, run_dir: Path, rank: int, total_steps: int, start_step: int):
        self.enabled = rank == 0
        self.cfg, self.run_dir = cfg, run_dir
        self.history: list[dict] = []
        self.wandb_run = None
        self.tb = None
        self.progress = None
        if not self.enabled:
            return
        self.console = Console(file=sys.stdout, highlight=False)
        keep_rows_up_to(run_dir / "metrics.jsonl", start_step)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
            self.progress.start()
        if LoggerKind.wandb in sinks(cfg):
            self.wandb_run = _init_wandb(cfg, run_dir)
        if LoggerKind.tensorboard in sinks(cfg):
            self.tb = _init_tensorboard(run_dir, start_step)

    def print(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, markup=False, soft_wrap=True)

    def config_changed(self, cfg: Config) -> None:
        """The run's config changed under it (train.oom_backoff): W&B's config says so too
        (config.yaml is written by the caller)."""
        if self.enabled and self.wandb_run is not None:
            self.wandb_run.config.update(to_dict(cfg), allow_val_change=True)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        self.history.append(metrics)
        self._write_row(metrics)
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
        if self.tb is not None:
            for k, v in metrics.items():
                if k != "step":
                    self.tb.add_scalar(k, v, metrics["step"], new_style=True, double_precision=True)
        line = (
            f"step {metrics['step']:>6}  loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  "
            f"gnorm {metrics['grad_norm']:.3f}  {metrics['tokens_per_s']:,.0f} tok/s  "
            + (f"mfu {100 * metrics['mfu']:.1f}%  " if "mfu" in metrics else "")
            + f"peak {metrics['mem/peak_bytes'] / 2**20:,.0f} MiB"
            + (f"  skipped {metrics['skipped_steps']} (fp16 overflow)" if metrics.get("skipped_steps") else "")
            + (f"  val {metrics['val/loss']:.4f}" if "val/loss" in metrics else "")
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=metrics["step"], info=f"loss {metrics['loss']:.4f}")
            self.progress.console.print(line, markup=False)
        else:
            self.console.print(line, markup=False, soft_wrap=True)

    def _write_row(self, metrics: dict) -> None:
        """metrics.jsonl; a failed write (a full disk) is said once and training goes on: the
        checkpoint that follows stops the run if the disk stays full."""
        if self.jsonl is None:
            return
        try:
            self.jsonl.write(json.dumps(metrics) + "\n")
        except OSError as err:
            print(
                f"metrics.jsonl: {err.strerror or err}; later rows go to the console only", file=sys.stderr, flush=True
            )
            with contextlib.suppress(OSError):
                self.jsonl.close()
            self.jsonl = None

    def finish(self, summary: dict) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.stop()
        table = Table(title=f"run {self.cfg.run_name or self.run_dir.name}", show_header=False)
        for k, v in flat_summary(summary).items():
            taken = v is not None and not (isinstance(v, list) and v and all(x is None for x in v))
            if taken:  # not: mfu without a known peak, digests not asked for, a CPU rank's device peak
                table.add_row(k, _fmt(v))
        self.console.print(table)
        try:
            (self.run_dir / "summary.json").write_text(jsonout.dumps(summary, indent=1) + "\n")
        except OSError as err:
            print(
                f"summary.json: {err.strerror or err}; the summary above is the run's record",
                file=sys.stderr,
                flush=True,
            )
        if self.jsonl is not None:
            with contextlib.suppress(OSError):
                self.jsonl.close()
        if self.wandb_run is not None:
            for k, v in flat_summary(summary).items():
                if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                    v = max(v)  # per-rank figures: the worst rank
                if isinstance(v, (int, float, str)):
                    self.wandb_run.summary[k] = v
            self.wandb_run.finish()
        if self.tb is not None:
            self.tb.close()


def flat_summary(summary: dict) -> dict:
    """Nested groups as `group/key` (startup/host_peak_bytes: one value per rank)."""
    out = {}
    for k, v in summary.items():
        if isinstance(v, dict) and k != "model_state_where":
            out.update({f"{k}/{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


def _fmt(v) -> str:
    if isinstance(v, list):
        if v and all(x == v[0] for x in v):
            return f"same on all {len(v)} ranks ({str(v[0])[:12]}...)"
        return ", ".join(str(x)[:12] for x in v)
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:,.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def sinks(cfg: Config) -> set[LoggerKind]:
    """The metric sinks beside the console and metrics.jsonl: logger.name and logger.also."""
    return ({cfg.logger.name} | set(cfg.logger.also)) - {LoggerKind.none}


def _init_tensorboard(run_dir: Path, start_step: int):
    """RUN_DIR/tensorboard. A resumed launch purges events logged after its checkpoint by
    the launch before (a crash after the last save), so each step appears once. Flushed
    every 10 s (torch's default is 120): a crash loses little of what metrics.jsonl kept."""
    from torch.utils.tensorboard import SummaryWriter  # local: optional (tensorboard)

    return SummaryWriter(
        log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None, flush_secs=10
    )


WANDB_INIT_TIMEOUT_S = 30  # online: wandb's default is 90 s of retries before it gives up
WANDB_OFFLINE_INIT_TIMEOUT_S = 120  # offline there is no server to wait for: only a loaded host's slow start


def wandb_mode(cfg: Config) -> str:
    mode = cfg.logger.mode
    if mode == WandbMode.auto:
        return "online" if _has_wandb_credentials() else "offline"
    return mode.value


def _has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def wandb_unreachable(timeout_s: float = 5.0) -> str | None:
    """None when the W&B server (WANDB_BASE_URL, else api.wandb.ai) accepts a connection
    within timeout_s; else why not, in a few words. Compute nodes often have no route out."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return None  # through a proxy: a direct connection proves nothing; the ranks fall back if need be
    settings = configparser.ConfigParser()  # where `wandb login --host` records a server
    settings.read(Path(os.environ.get("WANDB_CONFIG_DIR", Path.home() / ".config" / "wandb")) / "settings")
    base = os.environ.get("WANDB_BASE_URL") or settings.get("default", "base_url", fallback="https://api.wandb.ai")
    url = urlsplit(base)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout_s).close()
    except OSError as e:
        return f"cannot reach the W&B server {base} ({e.__class__.__name__}: {e})"
    return None


def _start_wandb(wandb, cfg: Config, run_dir: Path, run_id: str, mode: str):
    """wandb.init of this run in `mode`, its id and settings fixed (_init_wandb)."""
    timeout_s = WANDB_INIT_TIMEOUT_S if mode == "online" else WANDB_OFFLINE_INIT_TIMEOUT_S
    return wandb.init(
        project=cfg.logger.project,
        entity=cfg.logger.entity,
        group=cfg.logger.group,
        tags=list(cfg.logger.tags) or None,
        name=cfg.run_name or run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        config={**to_dict(cfg), "provenance": provenance.for_wandb(run_dir)},
        mode=mode,  # type: ignore[arg-type]  # one of wandb's modes (logger.mode)
        settings=wandb.Settings(
            console="off",
            silent=True,
            disable_git=True,
            save_code=False,
            x_save_requirements=False,
            init_timeout=timeout_s,
            # system metrics (GPUs by NVML): W&B's service samples them
            x_disable_stats=cfg.logger.system_metrics_s <= 0,
            x_stats_sampling_interval=max(cfg.logger.system_metrics_s, 0.1),
        ),
    )


def _init_wandb(cfg: Config, run_dir: Path):
    """The W&B run, resumed by the id in RUN_DIR/wandb_id. Logging never ends a run: an
    online start that fails (no route, a rejected key) falls back to offline files in
    RUN_DIR/wandb (`wandb sync` them later), and if even that fails the run goes on
    without W&B; each case says so in one line."""
    import wandb  # local: start-up (wandb, 3.7 s)

    # WANDB_SERVICE inherited from whatever started the launcher (a notebook, a sweep, a test
    # process) names that process's W&B service: this run would live and die with it, and a
    # run id it still holds (a killed launch's) refuses the relaunch ("run ID ... is in use").
    # A rank 0 starts its own.
    os.environ.pop("WANDB_SERVICE", None)
    id_file = run_dir / "wandb_id"
    if id_file.exists():
        run_id = id_file.read_text().strip()
    else:
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        id_file.write_text(run_id + "\n")

    mode = wandb_mode(cfg)
    try:
        return _start_wandb(wandb, cfg, run_dir, run_id, mode)
    except Exception as e:  # noqa: BLE001 -- anything W&B raises: logging is optional
        why = f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if mode != "online":
            print(f"W&B could not start ({why}); this run goes on without W&B", file=sys.stderr, flush=True)
            return None
        print(
            f"W&B could not start online ({why}); logging offline to {run_dir / 'wandb'} (wandb sync it later)",
            file=sys.stderr,
            flush=True,
        )
    try:
        wandb.teardown()  # the failed start still holds the run id in W&B's service process
        return _start_wandb(wandb, cfg, run_dir, run_id, "offline")
    except Exception as e:  # noqa: BLE001
        print(
            f"W&B could not start offline either ({e.__class__.__name__}); this run goes on without W&B",
            file=sys.stderr,
            flush=True,
        )
        return None
