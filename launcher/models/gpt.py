"""The project's decoder-only transformer, Llama-style.

Pre-norm blocks: RMSNorm -> attention with rotary positions -> residual, RMSNorm ->
SwiGLU MLP -> residual; a final RMSNorm and an output head (optionally tied to the
embedding). No dropout, no biases but model.attn_bias's (q, k, v); model.qk_norm: q and k
normed per head. Parameter names are stable whatever the activation
checkpointing mode, so checkpoints move between modes and recipes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from launcher.config import ACMode, ModelConfig, head_dim, is_moe_block, matmul_params
from launcher.models.attention import Attention, DocumentMask, rotary_at, rotary_table
from launcher.models.init import InitSpec, init_skipped
from launcher.models.layers import FeedForward, RMSNorm
from launcher.models.moe import MoE, routers, take_aux
from launcher.models.moe import init_specs as moe_specs
from launcher.models.offload import ActivationOffload


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if is_moe_block(cfg, index):  # model.moe: routed experts (launcher/models/moe.py)
            self.feed_forward = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        # mask by keyword: tensor parallel's input layouts name the positional inputs only
        x = x + self.attention(self.attention_norm(x), rope, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.tie_embeddings:
            self.output = tied_head(self.tok_embeddings.weight)
        else:
            self.output = Head(cfg.dim, cfg.vocab_size, bias=False)
        # Not a parameter or persistent buffer: rebuilt on load, never checkpointed.
        self.register_buffer("rope", rotary_table(head_dim(cfg), cfg.max_seq_len, cfg.rope_theta), persistent=False)
        self.checkpointed: set[int] = set()  # block indices recomputed in backward
        self.op_level = False  # activation_checkpointing=op: they keep their matmuls' outputs
        self.loss_chunks = 1  # train.loss_chunks (models.prepare): the loss over this many slices of the sequence
        self.offload_activations = False  # train.activation_offload (models.prepare)
        self._offload: Any = None  # its ActivationOffload, made at the first forward (on the device)
        # A GPT built on its own (tests, the hand-written bench loops) draws its weights from
        # torch's global RNG, as any nn.Module. The launcher builds it under skip_torch_init
        # on the meta device instead, and each rank fills only its part with values that do
        # not depend on the layout (launcher/models/init.py, with init_specs below).
        if not init_skipped():
            self.init_weights()

    # -------------------------------------------------------------------------- init
    @torch.no_grad()
    def init_weights(self) -> None:
        """Standalone init from torch's RNG, by the rule init_specs() writes down."""
        specs = init_specs(self.cfg)
        for name, p in self.named_parameters():
            spec = specs[name]
            if spec.kind == "normal":
                nn.init.normal_(p, std=spec.std)
            else:
                p.fill_(1.0 if spec.kind == "ones" else 0.0)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The rotary table (computed, never loaded), fp32 on its device (zero.Init made it bf16);
        an MoE's routers' balancing biases and step counts zero (a checkpoint loads the biases after)."""
        table = rotary_table(head_dim(self.cfg), self.cfg.max_seq_len, self.cfg.rope_theta)
        self.register_buffer("rope", table.to(self.rope.device), persistent=False)

        for buffer in (b for _, router in routers(self) for b in router.buffers()):
            buffer.data = torch.zeros(buffer.shape, dtype=torch.float32, device=buffer.device)

    # -------------------------------------------------------------------------- forward
    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits, or the mean cross-entropy over the counted targets (not -100) when
        targets are given. `positions` (B, T): packed samples (launcher/models/attention.py)."""
        h = self.tok_embeddings(tokens)
        h = self.run_blocks(enumerate(self.layers), h, positions)
        h = self.norm(h)
        if targets is None:
            return self.output(h)
        loss = self.output(h, targets, self.loss_chunks) if self.loss_chunks > 1 else lm_loss(self.output(h), targets)
        return self.with_aux(loss)

    def with_aux(self, loss: torch.Tensor) -> torch.Tensor:
        """Training an MoE with balance=aux_loss: plus the blocks' auxiliary losses (moe.py)."""
        aux = take_aux() if self.cfg.moe.experts and torch.is_grad_enabled() else None
        return loss if aux is None else loss + aux.to(loss.device)

    def run_blocks(self, layers, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(index, block) pairs in order: a pipeline stage's middle (launcher/parallel/cuts.py's Stage)."""
        mask = None if positions is None else DocumentMask(positions)
        return run_layers(
            layers, h, rotary_at(self.rope, positions), self.checkpointed, self.op_level, self.offload(h), mask
        )

    def offload(self, h: torch.Tensor):
        """train.activation_offload: the hooks that move what the blocks save to the host."""
        if not self.offload_activations or not torch.is_grad_enabled():
            return None
        if self._offload is None:
            self._offload = ActivationOffload(h.device).watch(self)
        return self._offload

    # -------------------------------------------------------------------------- facts
    def num_params(self) -> int:
        """Unique parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per matmul weight (forward 2, backward 4), the
        output head included even when tied, plus attention scores and values:
        12 * layers * dim * seq_len (PaLM appendix B). Recomputation is not counted:
        MFU measures useful work."""
        return flops_per_token(self.cfg, seq_len)


def tied_head(weight: nn.Parameter) -> "Head":
    """An nn.Linear whose weight is `weight` (the embedding's), made without allocating a
    weight of its own first: under deepspeed.zero.Init that weight would be built and
    partitioned only to be dropped (vocab x dim bytes held through start-up)."""
    head = Head.__new__(Head)
    nn.Module.__init__(head)  # not nn.Linear's __init__, which allocates (and zero.Init would partition)
    head.out_features, head.in_features = tuple(getattr(weight, "ds_shape", weight.shape))  # ZeRO-3: the full shape
    head.weight = weight
    head.register_parameter("bias", None)
    return head


def init_specs(cfg: ModelConfig) -> dict[str, InitSpec]:
    """GPT-2 style, by parameter name: normal(0, init_std); the residual projections (wo,
    w2) scaled by 1/sqrt(2 n_layers), so the residual stream's variance does not grow with
    depth; norms ones. A tied head shares the embedding's entry."""
    std = cfg.init_std
    resid = InitSpec(std=std / math.sqrt(2 * cfg.n_layers))
    specs = {"tok_embeddings.weight": InitSpec(std=std), "norm.weight": InitSpec("ones")}
    if not cfg.tie_embeddings:
        specs["output.weight"] = InitSpec(std=std)
    for i in range(cfg.n_layers):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            specs[f"layers.{i}.{name}.weight"] = InitSpec(std=std)
        for name in ("attention.wo", "feed_forward.w2"):
            specs[f"layers.{i}.{name}.weight"] = resid
        for name in ("attention_norm", "ffn_norm") + (("attention.q_norm", "attention.k_norm") if cfg.qk_norm else ()):
            specs[f"layers.{i}.{name}.weight"] = InitSpec("ones")
        for name in ("wq", "wk", "wv") if cfg.attn_bias else ():
            specs[f"layers.{i}.attention.{name}.bias"] = InitSpec("zeros")
        if is_moe_block(cfg, i):  # the dense names above replaced by the router's and experts'
            for name in ("w1", "w2", "w3"):
                del specs[f"layers.{i}.feed_forward.{name}.weight"]

            specs |= moe_specs(cfg, f"layers.{i}.feed_forward", std, resid)
    return specs


def run_layers(
    layers,
    h: torch.Tensor,
    rope: torch.Tensor,
    checkpointed: set[int],
    op_level: bool = False,
    offload=None,
    mask: DocumentMask | None = None,
) -> torch.Tensor:
    """The blocks in order; (index, block) pairs. Blocks in `checkpointed` keep only their
    input and recompute the rest in backward (activation checkpointing); with `op_level`
    they keep attention's output and every other matmul's too (keep_matmuls). `offload`: saved
    tensors hooks (launcher/models/offload.py) around them all. `mask`: packed samples'."""
    with offload if offload is not None else contextlib.nullcontext():
        return _run_layers(layers, h, rope, checkpointed, op_level, mask)


def _run_layers(layers, h, rope, checkpointed, op_level, mask=None):
    for i, layer in layers:
        if i in checkpointed and torch.is_grad_enabled():
            table = _as_fsdp_casts(layer, rope, h)
            if op_level:
                h = checkpoint(layer, h, table, mask, use_reentrant=False, context_fn=keep_matmuls)
            else:
                h = checkpoint(layer, h, table, mask, use_reentrant=False)
        else:
            h = layer(h, rope, mask)
    return h


def _as_fsdp_casts(layer: nn.Module, rope: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The rotary table for a checkpointed block; an FSDP block's already in the dtype its mixed
    precision casts inputs to (bf16), outside the checkpoint: torch < 2.13 does not cast again
    when backward recomputes the block, which then differs from its forward (torch 2.11)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no block is an FSDP one
    return rope.to(h.dtype) if fsdp is not None and isinstance(layer, fsdp.FSDPModule) else rope


# What op-level recomputation keeps (torch.utils.checkpoint's selective policy, as
# torchtitan's op-level SAC): the outputs of attention and of every other matmul of a block
# (the 1st, 3rd, 5th, 7th: wq, wv, w1, w2); the other matmuls (wk, wo, w3) and the
# elementwise work between them (norms, SiLU, products, casts, rotary) run again in backward.
MATMUL_OPS = frozenset(
    op
    for name in ("mm", "addmm", "bmm")
    if hasattr(torch.ops.aten, name)
    for op in [getattr(torch.ops.aten, name).default]
)
ATTENTION_OPS = frozenset(
    op
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
    for op in [getattr(torch.ops.aten, name).default]
)
ATTENTION_OPS |= {torch.ops.higher_order.flex_attention} if hasattr(torch.ops.higher_order, "flex_attention") else set()


def _keep_policy():
    """A fresh policy for one checkpointed block: it counts the block's matmuls, in forward
    and in the recomputation separately (each must decide alike), and keeps the odd ones."""
    seen = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op in ATTENTION_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op in MATMUL_OPS:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def keep_matmuls():
    """checkpoint's context_fn for activation_checkpointing=op (also handed to Hugging Face
    models' own checkpointing, launcher/models/hf.py): called once per block and forward."""
    return create_selective_checkpoint_contexts(_keep_policy())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the counted targets (-100: not counted), in fp32;
    0 with zero gradients when none counts (a chat window of prompt alone), never NaN."""
    total = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
    return total / counted(targets)


COUNTED: contextvars.ContextVar[float | None] = contextvars.ContextVar("counted", default=None)
"""Masked data (data=chat): the step's counted targets over all data-parallel ranks, per
loss call (launcher/rank/loop.py sets it for each step): every loss divides its sum by it
instead of by its own count, so the step's gradient is the mean over every counted token
of the step (as transformers' num_items_in_batch), whatever the micro-batch, accumulation
and world size. None: each call's own count (plain text: the same number)."""


@contextlib.contextmanager
def counting(per_call: float | None):
    """COUNTED set to `per_call` inside the block (None: each loss counts its own)."""
    token = COUNTED.set(per_call)
    try:
        yield
    finally:
        COUNTED.reset(token)


def counted(targets: torch.Tensor) -> torch.Tensor:
    """The divisor of a loss over `targets`: COUNTED, or its own counted targets (at least 1:
    none counted gives 0, never NaN)."""
    per_call = COUNTED.get()
    if per_call is not None:
        return torch.tensor(per_call, dtype=torch.float32, device=targets.device)
    return (targets != -100).sum().clamp(min=1)


class Head(nn.Linear):
    """The output projection. Called with targets and chunks > 1 it returns the loss
    instead of logits, computed over slices of the sequence (SlicedLoss): called as a
    module either way, so ZeRO-3 gathers its weight and tensor parallel sees an nn.Linear."""

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None, chunks: int = 1) -> torch.Tensor:
        if targets is None:
            return super().forward(h)
        if not torch.is_grad_enabled():  # an evaluation: the loss alone, slice by slice
            count = counted(targets)  # none counted: 0
            return (
                sum(
                    F.cross_entropy(F.linear(a, self.weight).float().flatten(0, 1), b.flatten(), reduction="sum")
                    for a, b in zip(h.chunk(chunks, 1), targets.chunk(chunks, 1))
                )
                / count
            )
        return SlicedLoss.apply(h, self.weight, targets, chunks)


class SlicedLoss(torch.autograd.Function):
    """Mean next-token cross-entropy of h @ weight.T over `chunks` slices of the sequence,
    with its gradients computed slice by slice in forward (as Liger-Kernel's fused linear
    cross-entropy): a slice's logits are made, turned into their gradient (softmax - one-hot)
    and freed before the next, so the B x T x V logits never exist at once. What it keeps for
    backward: dL/dh (h's size) and dL/dweight (the weight's size, accumulated in fp32: its
    matmul runs in fp32, TF32 on CUDA, about 2% of a Llama step's FLOPs).
    Matmuls run in autocast's dtype when autocast is on (as nn.Linear would), the softmax in
    fp32. The same loss and gradients as lm_loss(head(h)) to rounding; no extra FLOPs."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else weight.dtype
        with torch.autocast(h.device.type, enabled=False):
            hd, wd = h.to(dtype), weight.to(dtype)
            grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
            grad_h = torch.empty_like(h) if grads else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            count = counted(targets)  # none counted: loss 0, gradients 0
            for sl in _slices(h.size(1), chunks):
                hc, tc = hd[:, sl].reshape(-1, h.size(-1)), targets[:, sl].reshape(-1)
                logits = (hc @ wd.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                keep = tc != -100
                rows = torch.arange(tc.numel(), device=tc.device)
                picked = logits[rows, tc.clamp(min=0)]
                total += ((lse - picked) * keep).sum()
                if not grads:
                    continue
                g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                g[rows, tc.clamp(min=0)] -= 1.0
                g.mul_(keep[:, None])
                grad_h[:, sl] = (g.to(dtype) @ wd).view(h.size(0), -1, h.size(-1)).to(h.dtype)
                grad_w.addmm_(g.t(), hc.float())  # in fp32, in place: no weight-sized temporary
                del logits, g
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_out / count
        # In place: at the start of backward every activation is still held, so a scaled
        # copy of dL/dweight would land on the step's peak.
        grad_h.mul_(scale.to(grad_h.dtype))
        return grad_h, grad_w.mul_(scale).to(ctx.weight_dtype), None, None


def _slices(length: int, chunks: int) -> list[slice]:
    step = -(-length // chunks)
    return [slice(i, min(i + step, length)) for i in range(0, length, step)]


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.dim * seq_len


def set_activation_checkpointing(model: GPT, mode: ACMode, every: int) -> None:
    """Choose which blocks recompute their activations in backward.
    full: all blocks; selective: every `every`-th block (0, N, 2N, ...); op: all blocks,
    keeping attention's and every other matmul's outputs; none: no block."""
    n = len(model.layers)
    model.op_level = mode == ACMode.op
    if mode in (ACMode.full, ACMode.op):
        model.checkpointed = set(range(n))
    elif mode == ACMode.selective:
        model.checkpointed = set(range(0, n, every))
    else:
        model.checkpointed = set()
