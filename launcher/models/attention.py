"""The decoder's attention: rotary positions, grouped-query attention, and the mask of
packed windows (data.document_masking).

Without positions attention is causal over the whole window (SDPA's is_causal: no mask
at all, the fastest kernels). With positions (B, T), several samples share a window: a
sample starts where positions == 0, rotary angles come from the positions (they restart
at each sample) and attention is block-causal, each token seeing the earlier tokens of
its own sample only (document ids: doc = cumsum(positions == 0)). `DocumentMask` makes
that mask once per forward and every layer shares it:

  CUDA   FlexAttention with a block mask (torch.compile'd flex_attention): O((T/128)^2)
         block indices, blocks wholly outside a sample skipped.
  CPU    SDPA with an additive mask, 0 or -inf, B x 1 x T x T in the query's dtype, made
         once and shared. FlexAttention has no backward on CPU (torch 2.13:
         "FlexAttention does not support backward on CPU"), so it cannot train there.
         The mask is additive, not boolean: SDPA turns a boolean mask into a float copy at
         every call and saves that copy for backward (one B x T x T copy per layer,
         measured); a float mask of the query's dtype is saved by reference, once.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from launcher.config import ModelConfig, head_dim
from launcher.models.layers import RMSNorm
from launcher.parallel.context import heads_to_seq, seq_to_heads


def rotary_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """(max_seq_len, head_dim/2, 2): cos and sin for each position and frequency, on the
    current default device. Computed on the CPU: the same values wherever it lands, and on
    the meta device torch would first spend about a second setting up its reference kernels
    (on every launch and every rank)."""
    cpu = torch.device("cpu")
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=cpu) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=cpu), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).to(torch.get_default_device())


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim). Rotates pairs of channels by position. `table`:
    the whole rotary table (positions 0..seq-1), or one row per token, (batch, seq,
    head_dim/2, 2), the table at each token's position (`rotary_at`)."""
    t = x.shape[1]
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    if table.dim() == 4:
        if table.shape[:2] != x.shape[:2]:  # e.g. a sequence split (sequence parallel) the positions did not follow
            raise ValueError(
                f"rotary positions of shape {tuple(table.shape[:2])} for a (batch, seq) of {tuple(x.shape[:2])}"
            )
        cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]
    else:
        cos, sin = table[:t, None, :, 0], table[:t, None, :, 1]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


def rotary_at(table: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The rotary rows the blocks use: the table itself without positions, else the
    table's row at each token's position, (B, T, head_dim/2, 2)."""
    return table if positions is None else table[positions]


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(B, T): which sample of its window each token belongs to, counted from where
    positions restart at 0 (tokens before the first 0 belong to sample 0)."""
    return torch.cumsum(positions == 0, dim=1)


class DocumentMask:
    """The block-causal mask of a packed micro-batch, made once per forward and shared by
    the layers (passed to them as an object, not a tensor, so FSDP's input casts leave it
    alone). `flex`: FlexAttention's BlockMask (CUDA); otherwise SDPA's additive mask, made
    at the first layer in the query's dtype and kept for the rest."""

    def __init__(self, positions: torch.Tensor, flex: bool | None = None):
        if positions.dim() != 2:
            raise ValueError(f"positions must be (batch, seq), got shape {tuple(positions.shape)}")
        self.docs = document_ids(positions)
        self.flex = positions.is_cuda if flex is None else flex
        self._additive: dict[torch.dtype, torch.Tensor] = {}
        self._block = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.docs.shape)

    def allowed(self) -> torch.Tensor:
        """(B, 1, T, T) booleans: query i sees key j (same sample, j <= i)."""
        t = self.docs.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=self.docs.device).tril()
        return ((self.docs[:, :, None] == self.docs[:, None, :]) & causal)[:, None]

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1, T, T) in `dtype`: 0 where a query sees a key, -inf elsewhere."""
        if dtype not in self._additive:
            allowed = self.allowed()
            self._additive[dtype] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf")
            )
        return self._additive[dtype]

    def block_mask(self):
        """FlexAttention's BlockMask (heads broadcast), made once."""
        if self._block is None:
            docs = self.docs

            def same_sample_causal(b, h, q, k):
                return (docs[b, q] == docs[b, k]) & (k <= q)

            b, t = docs.shape
            self._block = create_block_mask(
                same_sample_causal, b, None, t, t, device=docs.device, _compile=docs.is_cuda
            )
        return self._block

    def check(self, q: torch.Tensor) -> None:
        """q: (B, heads, T, head_dim). The mask must cover the sequence attention sees."""
        if (q.shape[0], q.shape[2]) != self.shape:
            raise ValueError(
                f"positions of shape {self.shape} for attention over (batch, seq) ({q.shape[0]}, {q.shape[2]})"
            )


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None) -> torch.Tensor:
    """(B, heads, T, head_dim) each, as many key/value heads as query heads: causal
    attention, block-causal within each sample under `mask`."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask.check(q)
    if mask.flex:
        if q.is_cuda:
            return _compiled_flex()(q, k, v, block_mask=mask.block_mask())
        return flex_attention(q, k, v, block_mask=mask.block_mask())  # CPU, forward only (tests)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.additive(q.dtype))


class Attention(nn.Module):
    """q, k, v projections (biases with model.attn_bias), q and k normed per head
    (model.qk_norm, before rotary as Qwen3), rotary, attention, the o projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = head_dim(cfg)
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=cfg.attn_bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.attn_bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.attn_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.cp_group = None  # parallel.cp > 1: this rank's context-parallel group (launcher/parallel/context.py)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 rather than the configured head count: under tensor parallelism each rank
        # holds a slice of the heads.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cp_group is not None:  # this rank's positions, all heads -> all positions, its heads
            cp = self.cp_group.size()
            if k.shape[2] % cp:  # key/value heads that do not split: repeated to the query heads first
                k, v = (y.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for y in (k, v))
            q, k, v = (seq_to_heads(y, self.cp_group) for y in (q, k, v))
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))  # (b, heads, t, head_dim)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = attend(q, k, v, mask).transpose(1, 2)
        if self.cp_group is not None:
            y = heads_to_seq(y, self.cp_group)
        return self.wo(y.reshape(b, t, -1))
