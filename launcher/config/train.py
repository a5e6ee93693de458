"""train.*, optim.*, precision.*, dist.*: the step, the optimizer and its schedule,
the numerics, the collectives' timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from launcher.config.enums import ACMode, Backend, Precision


@dataclass
class OptimConfig:
    name: str = "adamw"
    """The optimizer (launcher/optim/, one conf/optim/<name>.yaml each), by its state bytes
    per trainable parameter: adamw 8 (two fp32 moments); adamw8bit about 2 and adamw4bit
    about 1 (torchao's block-wise quantized moments: 1/4 and 1/8 of the memory, a little
    noise in the update; tensors under 4096 elements keep fp32 moments); adafactor 4 x
    (rows + columns) per matrix (a factored second moment, no first moment: the least
    memory, a different, relative step size: its own lr scale); muon 4 for the hidden
    matrices (one momentum, orthogonalised by Newton-Schulz: more FLOPs per step, fewer
    steps to a loss), AdamW's 8 for the embedding, head and vectors. Not under DeepSpeed's
    ZeRO (it runs its own AdamW on flat partitions): adamw there."""
    lr: float = 1e-3
    """Peak learning rate, reached after warm-up."""
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio at the last step."""
    warmup_steps: int = 20
    """Linear warm-up from 0; stabilises Adam's early, noisy second-moment estimates. Longer
    than train.steps: clamped to it, with a warning (a short run warms up throughout)."""
    weight_decay: float = 0.1
    """Decoupled decay on matrices only (norms and biases are not decayed)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off). Guards against loss spikes."""
    fused: Optional[bool] = None
    """Fused AdamW kernel (null: on for CUDA, off on CPU where it does not exist); adamw and
    muon's AdamW part only."""
    adafactor_beta2_decay: float = -0.8
    """adafactor: the second moment's decay is 1 - step^this (torch's default -0.8): closer
    to 0 forgets faster. Its lr is relative (a step is lr x the parameter's RMS, lr capped
    at 1/sqrt(step)): about 1e-2, not AdamW's."""
    adafactor_clip: float = 1.0
    """adafactor: an update whose RMS exceeds this is scaled down to it (torch's d): lower
    is steadier, slower."""
    muon_momentum: float = 0.95
    """muon: momentum of the matrices' update (the Muon authors' 0.95)."""
    muon_nesterov: bool = True
    """muon: Nesterov momentum (the authors' default)."""
    muon_ns_steps: int = 5
    """muon: Newton-Schulz iterations orthogonalising each matrix's update: each costs about
    3 matmuls of the matrix's size in bf16; fewer is cheaper and less orthogonal."""
    muon_adjust_lr: str = "match_rms_adamw"
    """muon: how the matrices' lr scales with their shape: match_rms_adamw (Moonshot: 0.2 x
    sqrt(max(rows, cols)), so AdamW's lr and weight decay carry over and one schedule drives
    both parts) or original (Keller Jordan's sqrt(max(1, rows/cols)): wants lr about 0.02)."""


@dataclass
class PrecisionConfig:
    name: Precision = Precision.bf16
    """bf16: autocast to bfloat16, fp32 master weights; same range as fp32, no scaler.
    fp16: autocast to float16 with a dynamic loss scaler (CUDA only); fp32: no autocast,
    slowest on tensor cores, the reference for correctness checks."""
    initial_scale: float = 65536.0
    """fp16: the loss scale to start from (halved on overflow)."""
    growth_interval: int = 1000
    """fp16: steps without overflow before the scale doubles."""
    min_scale: float = 1.0
    """fp16: the scale never drops below this (DeepSpeed's min_loss_scale)."""
    fp8: bool = False
    """precision=fp8 (name bf16 with this on): the blocks' linear layers compute in float8
    through torchao's Float8Linear with rowwise scales, the rest in bf16 autocast; about
    1.3-1.5x the bf16 matmul speed on Hopper/Ada/Blackwell (sm 8.9+), at a small loss
    difference. ddp and fsdp (weights all-gathered in bf16: torchao's float8 all-gather is
    tensorwise only), the project's decoder and Llama-family model=hf. Checkpoints are
    bf16/fp32 as usual (the same parameter names)."""
    fp8_emulate: bool = False
    """fp8 with the float8 matmuls emulated in higher precision (torchao's emulate): runs
    on CPU and older GPUs, slower than bf16. For tests, never for training."""
    tf32: bool = True
    """On CUDA, fp32 matmuls (precision=fp32, and what autocast leaves in fp32) run on the
    tensor cores in TF32: 10-bit mantissa, fp32 range, about 8x faster on Ampere and newer
    (torch's own default is IEEE fp32). false: IEEE fp32, for bitwise comparisons. No effect on CPU."""


@dataclass
class TrainConfig:
    steps: int = 200
    """Optimizer steps."""
    micro_batch: int = 8
    """Sequences per rank per forward/backward. Activation memory grows linearly with it."""
    grad_accum: int = 1
    """Micro-batches per optimizer step. Larger global batch at no memory cost, but
    proportionally more time per step."""
    oom_backoff: bool = False
    """After an out-of-memory in a step, go on with the next smaller micro-batch that divides
    this one and the accumulation that keeps micro_batch x grad_accum (so the global batch
    and the learning dynamics) the same: 8 x 1 -> 4 x 2. In the rank, retrying the same
    step, where it can (one rank, the ddp engine, the failure before the optimizer step);
    else the launcher launches again from the last checkpoint. Each back-off is one line,
    and config.yaml and the W&B config record it. train.micro_batch=auto turns it on."""
    global_batch: Optional[int] = None
    """Sequences per optimizer step over all ranks. When set, grad_accum is derived:
    global_batch / (micro_batch x data-parallel size), which must divide exactly."""
    seq_len: int = 128
    """Tokens per sequence. Attention activations grow with its square (without flash)."""
    stop_at: Optional[int] = None
    """End this launch after this step, with a checkpoint; the schedule still spans
    train.steps, so a later launch of the same run directory carries on (time-sliced
    jobs, tests of resume). A launch that starts at or past it (RUN_DIR/command.sh run
    again, a requeue, whose config.yaml still says it) trains on to train.steps.
    null = run to train.steps."""
    seed: int = 1234
    """Seeds model init and every RNG; the same seed gives the same run on CPU."""
    eval_every: int = 0
    """Every N steps (and at the last), every rank evaluates the loss on held-out data
    (synthetic: samples the training never draws; memmap: data.val_path, or the held-out
    data.val_fraction of the file) and rank 0 logs val/loss and val/perplexity. 0: never.
    Each evaluation costs a forward pass over train.eval_samples, no backward."""
    eval_samples: int = 64
    """Held-out samples per evaluation, split over the data-parallel ranks in micro-batches:
    always the same samples, whatever the ranks, so evaluations compare across steps,
    restarts and layouts. More: a steadier estimate, a longer pause. A multiple of
    micro_batch x data-parallel size (x grad_accum under a pipeline)."""
    max_bad_steps: int = 0
    """The loss guard (0: off). On, a step whose gradient norm or loss is not finite, or
    (train.spike_factor) whose loss jumps, is skipped: no optimizer update; the step number,
    the learning-rate schedule and the data go on. Each skip is one console line and counts
    in guard/skipped_steps. After this many bad steps in a row the weights and optimizer
    state go back to the newest checkpoint (guard/rollbacks), the data position goes on:
    the batches since that checkpoint are not seen again. A run with no checkpoint to go
    back to, or sent back 3 times in a row without a good step between, stops (exit 1).
    Costs one host read of two scalars a step (a device sync; a collective too with
    spike_factor). Not with recipe.zero.stage=0 (DeepSpeed's plain optimizer applies a
    non-finite step)."""
    spike_factor: float = 0.0
    """With the guard: a step whose loss (the mean over ranks) is above this x the mean of
    the last 32 applied steps' losses is bad (checked once 8 are in). 0: only non-finite
    steps are bad. Lower catches milder spikes and risks skipping an honest jump (a new
    data source); 2-5 is typical. fp16: non-finite steps are the loss scaler's (it skips
    and lowers its scale), not counted by the guard."""
    straggler_factor: float = 1.5
    """On each log step every rank times its own work (its forward's layers, outside the
    collectives' waits, and its data wait) and rank 0 logs the slowest rank and its lag
    (rank/slowest, rank/slowest_lag_s); a rank above this x the median of its peers (its
    pipeline stage) gets a console line naming it and its host. Costs, on log steps only,
    two timestamps per layer per forward and one all-gather of three numbers. 0: off.
    Lower flags smaller lags and noise with them; a slow GPU or data loader is typically
    well above 1.5."""
    activation_checkpointing: ACMode = ACMode.none
    """none: keep all activations. full: recompute every block in backward (about a third
    more compute, activations shrink to one tensor per block). selective: recompute every
    ac_every-th block, a middle ground. op: every block keeps the outputs of attention
    and of every other matmul (wq, wv, w1, w2) and recomputes the other three matmuls and
    the cheap elementwise work (norms, SiLU, products, casts) in backward: about an eighth
    more compute, under half of none's activations (torch.utils.checkpoint with a
    selective policy, as torchtitan's op-level SAC)."""
    ac_every: int = 2
    """selective: recompute every N-th block."""
    loss_chunks: Optional[int] = None
    """The output projection and cross-entropy over N slices of the sequence, each slice's
    logits made, turned into their gradients and freed before the next (in forward: no
    extra FLOPs): the B x T x V logits (4 GiB in fp32 for V=128k, T=8k, one sample) never
    exist at once; held instead until backward: dL/dweight in fp32 (V x dim). 1: off. null
    (auto): the fewest slices, a power of two, that keep one slice's fp32 logits within
    256 MiB (1 for small vocabularies). The project's decoder without tensor or pipeline
    parallelism (elsewhere auto is 1 and N > 1 is refused)."""
    activation_offload: bool = False
    """What the blocks save for backward goes to host memory during forward and comes back
    for backward (CUDA: pinned memory, copies on a side stream, prefetched a few tensors
    ahead in backward; launcher/models/offload.py). Device activations shrink to the head's
    and the recomputed blocks' inputs; costs PCIe bandwidth (2 x the activations a step) and
    host memory, and time where the copies outrun compute. With checkpointing, the
    recomputed blocks' inputs go too (DeepSpeed's cpu_checkpointing). The project's
    decoder, without tensor parallel or compile."""
    compile: bool = False
    """torch.compile each block: faster steps after a compile pause at the start."""
    measure_activations: bool = False
    """Count the bytes autograd saves for backward during the second step of the launch
    (saved_tensors_hooks) and log them as mem/activation_bytes: checks the planner's
    prediction on real hardware. Costs a little time on that one step."""


@dataclass
class DistConfig:
    backend: Backend = Backend.auto
    """auto: nccl on CUDA, gloo on CPU."""
    timeout_s: int = 600
    """Collective timeout: a rank that stops answering ends the job after this long."""
    flight_recorder: int = 2000
    """torch's collective flight recorder: the last N collectives of each process group
    (NCCL and gloo), per rank (TORCH_FR_BUFFER_SIZE). A hang report compares the
    ranks' counts of collectives entered and names the one that never entered the one the
    others wait in; each rank's record lands in RUN_DIR/comm_trace/ for torch's analyzer
    (`python -m torch.distributed.flight_recorder.fr_trace`). A few microseconds a collective;
    0 turns it off."""
