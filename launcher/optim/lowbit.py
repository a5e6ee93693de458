"""adamw8bit, adamw4bit: torchao's AdamW8bit / AdamW4bit, AdamW with both moments
quantized block-wise (8 bits: a dynamic-tree code per element and an fp32 absmax scale per
256 elements; 4 bits: two codes a byte, a scale per 128). torchao quantizes a tensor
(its local shard under FSDP/TP) only when it holds at least 4096 elements, a multiple of
the block; smaller ones keep fp32 moments. Each quantized moment also keeps its code
table (256 or 16 fp32 values). Updates are computed in fp32 from the dequantized moments.

On CUDA torchao compiles its per-parameter step (torch.compile, once per shape); on CPU
the same function runs eagerly (launcher/optim/classes.py::LowBitAdamW: codes and scales
identical to the compiled step, parameters within 1 ulp; compiling costs about 17 s per
distinct shape on a CPU). Checkpoints hold the moments dequantized to fp32 (plain tensors
under AdamW's names: files load with weights_only, reshard, and load into adamw too).
"""

from __future__ import annotations

from launcher.config import OptimConfig

BITS = {"adamw8bit": 8, "adamw4bit": 4}
BLOCK = {8: 256, 4: 128}
"""torchao's default block sizes (elements per fp32 scale)."""
CODES = {8: 256, 4: 16}
"""Entries of each quantized moment's code table (fp32)."""
SMALLEST = 4096
"""torchao (after bitsandbytes) quantizes only tensors of at least this many elements."""


def quantized(bits: int, held: int) -> bool:
    return held >= SMALLEST and held % BLOCK[bits] == 0


def state_bytes(cfg: OptimConfig, t) -> int:
    bits = BITS[cfg.name]
    if not quantized(bits, t.held):
        return 8 * t.held
    per_moment = t.held * bits // 8 + 4 * (t.held // BLOCK[bits]) + 4 * CODES[bits]
    return 2 * per_moment


def validate(cfg: OptimConfig) -> None:
    pass


def build(groups: list[dict], model, cfg: OptimConfig, device):
    from launcher.optim.classes import low_bit_adamw  # local: torch (launch side)

    return low_bit_adamw(BITS[cfg.name], groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
