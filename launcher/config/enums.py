"""The allowed values of the config's choices (Enums: Hydra refuses any other) and
`ConfigError`, the one-line refusal every check raises.
"""

from __future__ import annotations

import enum
from typing import Any


class ConfigError(ValueError):
    """Bad input: names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value}: {allowed}")


# Pipeline schedules. Declared functionally because "1f1b" is not a Python identifier;
# the names are what the command line and config.yaml say (parallel.pp_schedule=1f1b).
PPSchedule = enum.Enum(
    "PPSchedule", {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved_1f1b": "interleaved_1f1b"}, type=str
)


PPSchedule.__doc__ = """gpipe: all forwards, then all backwards: simplest, but every micro-batch's
activations are alive at once. 1f1b: one forward, one backward in the steady state: the
same bubble, activations of at most `pp` micro-batches. interleaved_1f1b: each rank holds
pp_virtual_stages smaller stages; the bubble shrinks by that factor for more messages."""


class Precision(str, enum.Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class ACMode(str, enum.Enum):
    none = "none"
    full = "full"
    selective = "selective"
    op = "op"


class DataKind(str, enum.Enum):
    synthetic = "synthetic"
    memmap = "memmap"
    hf_text = "hf_text"
    chat = "chat"


class TrainOn(str, enum.Enum):
    """data=chat: which tokens count in the loss (the rest are context only)."""

    assistant = "assistant"
    """Every assistant turn (its content and its end-of-turn token), the default: what TRL's
    assistant_only_loss and axolotl's roles_to_train train on."""
    completion = "completion"
    """The last assistant turn of a `messages` row, or the whole `completion` of a
    prompt/completion row: earlier turns are context, as in TRL's completion_only_loss."""
    all = "all"
    """Every token of the rendered conversation (prompts, system turns and headers too)."""


class TextFormat(str, enum.Enum):
    """data=hf_text: how the files are read (auto: from the extension; docs/data.md)."""

    auto = "auto"
    json = "json"
    parquet = "parquet"
    text = "text"


class TokenDtype(str, enum.Enum):
    uint16 = "uint16"
    uint32 = "uint32"

    @property
    def width(self) -> int:
        """Bytes per token in the file."""
        return 2 if self == TokenDtype.uint16 else 4


class LoggerKind(str, enum.Enum):
    wandb = "wandb"
    none = "none"
    tensorboard = "tensorboard"


class OnExisting(str, enum.Enum):
    """What a fresh start does in a checkpoint folder that holds another run's checkpoints."""

    refuse = "refuse"
    archive = "archive"


class WandbMode(str, enum.Enum):
    auto = "auto"
    online = "online"
    offline = "offline"


class Backend(str, enum.Enum):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class Runner(str, enum.Enum):
    torchrun = "torchrun"
    deepspeed = "deepspeed"
    accelerate = "accelerate"


class OffloadDevice(str, enum.Enum):
    """Where ZeRO keeps a part of the model state: on the accelerator, or in host memory."""

    none = "none"
    cpu = "cpu"


class Scheduler(str, enum.Enum):
    """Who starts the nodes: nobody (`make train` here, other nodes by hand), Slurm or Kubernetes."""

    none = "none"
    slurm = "slurm"
    k8s = "k8s"


class K8sKind(str, enum.Enum):
    """The Kubernetes object `make submit cluster=k8s` renders (launcher/launch/submit/k8s.py)."""

    job = "job"
    """An Indexed batch/v1 Job and a headless Service: no operator needed. The completion
    index is the node rank; the Service's DNS names node 0 for the rendezvous."""
    trainjob = "trainjob"
    """A Kubeflow Trainer TrainJob (trainer.kubeflow.org/v1alpha1) on a torch runtime, for
    clusters that run the Trainer operator (it builds the JobSet, the node ranks and the
    rendezvous address: PET_* variables)."""


class ExportFormat(str, enum.Enum):
    safetensors = "safetensors"
    hf = "hf"


class ModelKind(str, enum.Enum):
    """gpt: the project's decoder (launcher/models/gpt.py); hf: a transformers causal LM."""

    gpt = "gpt"
    hf = "hf"


class LoraBase(str, enum.Enum):
    """model.lora.base_dtype: how the frozen base weights of a LoRA run are held."""

    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    nf4 = "nf4"


class HFAttention(str, enum.Enum):
    """model=hf: transformers' attention implementation (config._attn_implementation)."""

    sdpa = "sdpa"
    eager = "eager"


class ExportDtype(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class FaultPoint(str, enum.Enum):
    """Where `debug.fault` strikes (reliability tests; never set it for real training)."""

    save_staged = "save_staged"
    """checkpoint.async_save: SIGKILL of the rank from its writer thread, after the state
    was staged and training went on, before that thread writes (DCP's own writer may have
    begun)."""
    save_engine_written = "save_engine_written"
    """SIGKILL after every rank wrote its part of the checkpoint, before the manifest."""
    save_manifest_written = "save_manifest_written"
    """SIGKILL after the manifest, before the folder is renamed into place."""
    save_renamed = "save_renamed"
    """SIGKILL after the rename, before `latest` is updated."""
    save_latest_written = "save_latest_written"
    """SIGKILL after `latest` is updated, before old checkpoints are deleted."""
    resume_latest_moved = "resume_latest_moved"
    """SIGKILL of rank 0 at a resume that skipped a checkpoint failing its digests, after
    `latest` was moved to the one it resumes, before the failing one is set aside
    (`fault_step`: the step it resumes)."""
    hang = "hang"
    """The rank sleeps forever instead of fetching the batch of step `fault_step`."""
    hang_in_step = "hang_in_step"
    """The rank sleeps forever inside step `fault_step`, batch in hand, before its first
    collective: the others wait inside one (a rank stuck in a kernel or a host call)."""
    nan_loss = "nan_loss"
    """(Not `nan`: YAML reads that as a float.) The rank's loss becomes NaN (its model's output times NaN) at steps fault_step to
    fault_step + fault_steps - 1: the gradients, all-reduced, are NaN on every rank."""
    spike = "spike"
    """The rank's loss (or, on a pipeline's last stage, its logits) x 1000 at those steps."""
    slow = "slow"
    """The rank's forward takes debug.slow_s longer at those steps (a sleep in its first
    layer that holds parameters): a straggler, for train.straggler_factor."""
    oom = "oom"
    """The rank raises torch.OutOfMemoryError at the end of its first forward of step
    `fault_step` (where the logits are made), once per run directory: the back-off's
    smaller micro-batch then fits (train.oom_backoff)."""
