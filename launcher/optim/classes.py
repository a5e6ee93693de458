"""The optimizer classes of launcher/optim/'s families, each one torch.optim.Optimizer (the
engines step it, LambdaLR drives its lr, checkpoints take its state dict):

    LowBitAdamW8/4   torchao's AdamW8bit/4bit: the per-parameter step eager on CPU,
                     quantized moments dequantized into the state dict
    WholeAdafactor   torch's Adafactor, a sharded parameter stepped whole
    MuonAdamW        Muon's update for hidden matrices, AdamW's for the rest

Ranks import this module (torch, and torchao when installed); the launch side never does.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._adafactor import _single_tensor_adafactor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

try:  # the fp8 extra; without it the launch side refuses optim=adamw8bit/4bit (launcher/optim/__init__.py)
    from torchao.optim import AdamW4bit, AdamW8bit
    from torchao.optim.adam import single_param_adam
except ImportError:  # adafactor and muon need none of it
    AdamW4bit = AdamW8bit = torch.optim.AdamW

from launcher.models import model_layout

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a DTensor gathered; a plain tensor itself)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def own_part(whole_t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of `whole_t` as `like` (a DTensor) holds it, with no communication
    (every rank holds the same whole); `whole_t` itself where `like` is a plain tensor."""
    if not isinstance(like, DTensor):
        return whole_t
    return distribute_tensor(whole_t, like.device_mesh, like.placements, src_data_rank=None)


def _closure(closure):
    """What torch's optimizers do with step(closure): the loss it computes, with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# ----------------------------------------------------------------------------- low-bit AdamW
class _Eager:
    """torchao's step with its per-parameter function (`single_param_adam`) called as is
    on CPU, compiled (torchao's own step) elsewhere. Compiling it costs about 17 s per
    distinct parameter shape on a CPU, for a step whose codes and scales come out the same
    (parameters within 1 ulp: fusion). The moments go into state dicts dequantized to fp32
    (torch.load(weights_only) and DCP take plain tensors; they load into adamw too) and
    are quantized again on load."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_state_dict_post_hook(_dequantized)
        self.register_load_state_dict_post_hook(_requantized)

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        if not params or params[0].device.type not in ("cpu", "meta"):  # meta: make rehearse
            return super().step(closure)
        loss = _closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # as torchao's step
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = self._new_buffer(p, True)
                    state["exp_avg_sq"] = self._new_buffer(p, False)
                state["step"] += 1
                single_param_adam(
                    p.detach(),
                    p.grad,
                    state["step"],
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    None,
                    group["lr"],
                    group["betas"][0],
                    group["betas"][1],
                    group["weight_decay"],
                    group["eps"],
                    self.is_adamw,
                    self.bf16_stochastic_round and p.dtype is torch.bfloat16,
                )
        return loss


def _quantized(t) -> bool:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return hasattr(local, "dequantize") and type(local) is not torch.Tensor


def _dequantize(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, DTensor):
        return _values(t)
    return DTensor.from_local(
        _values(t._local_tensor), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )


def _values(q) -> torch.Tensor:
    """A quantized moment as fp32 values that torchao quantizes back to the same codes and
    scales (a resume continues exactly): the dequantized values, except that in each block
    an element at the signed table's lowest code (-0.9965 of the scale: the tables reach
    +1 but not -1) is written as minus the scale, so that the block's absolute maximum,
    the scale quantizing finds, is the scale itself."""
    values = q.dequantize().float()
    if q.qmap[0] >= 0:  # unsigned: the block's maximum is at code 1.0, exactly the scale
        return values
    blocks = values.view(-1, q.block_size)
    lowest = blocks.argmin(-1)
    rows = torch.arange(blocks.shape[0], device=blocks.device)
    at_lowest = blocks[rows, lowest] == q.qmap[0] * q.scale
    blocks[rows[at_lowest], lowest[at_lowest]] = -q.scale[at_lowest]
    return values


def _dequantized(optimizer, state_dict: dict) -> dict:
    """State-dict post hook: quantized moments as fp32 tensors (new dicts: the live state
    keeps its quantized tensors)."""
    state_dict["state"] = {
        i: {k: _dequantize(v) if _quantized(v) else v for k, v in s.items()} for i, s in state_dict["state"].items()
    }
    return state_dict


def _requantized(optimizer) -> None:
    """Load-state-dict post hook: fp32 moments back into quantized buffers."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in MOMENTS:
                if key in state and not _quantized(state[key]):
                    buffer = optimizer._new_buffer(p, key == "exp_avg")
                    buffer.copy_(state[key].to(buffer.device))
                    state[key] = buffer


class LowBitAdamW8(_Eager, AdamW8bit):
    pass


class LowBitAdamW4(_Eager, AdamW4bit):
    pass


def low_bit_adamw(bits: int, groups: list[dict], **kwargs) -> torch.optim.Optimizer:
    return {8: LowBitAdamW8, 4: LowBitAdamW4}[bits](groups, **kwargs)


# ----------------------------------------------------------------------------- Adafactor
class WholeAdafactor(torch.optim.Adafactor):
    """torch's single-tensor Adafactor on each parameter whole: a DTensor's parameter and
    gradient are gathered (one tensor at a time), stepped with whole row and column
    statistics (plain tensors, the same on every rank), and this rank's shard written back."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure(closure)
        for group in self.param_groups:
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                param, grad = whole(p.detach()), whole(p.grad)
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    if grad.dim() > 1:
                        state["row_var"] = grad.new_zeros((*grad.shape[:-1], 1))
                        state["col_var"] = grad.new_zeros((*grad.shape[:-2], 1, grad.shape[-1]))
                    else:
                        state["variance"] = torch.zeros_like(grad)
                if param.device.type == "meta":  # make rehearse: the states' shapes, no arithmetic (it reads values)
                    continue
                _single_tensor_adafactor(
                    [param],
                    [grad],
                    [state.get("row_var")],
                    [state.get("col_var")],
                    [state.get("variance")],
                    [state["step"]],
                    None,
                    None,
                    d=group["d"],
                    lr=group["lr"],
                    beta2_decay=group["beta2_decay"],
                    weight_decay=group["weight_decay"],
                    eps1=eps1,
                    eps2=eps2,
                    maximize=group["maximize"],
                    has_complex=False,
                )
                if isinstance(p, DTensor):
                    p._local_tensor.copy_(own_part(param, p)._local_tensor)
        return loss


# ----------------------------------------------------------------------------- Muon + AdamW
def muon_groups(groups: list[dict], model: torch.nn.Module, extra: dict) -> list[dict]:
    """launcher.rank.engine.param_groups' groups with the hidden matrices moved into a group
    of their own (`muon`: True, with Muon's settings `extra`); the embedding, the head and
    the vectors stay AdamW's."""
    layout = model_layout(model)
    aside = {id(p) for name, p in model.named_parameters() if name.startswith((f"{layout.embed}.", f"{layout.head}."))}
    out = []
    for group in groups:
        matrices = [p for p in group["params"] if p.ndim == 2 and id(p) not in aside]
        rest = [p for p in group["params"] if p.ndim != 2 or id(p) in aside]
        if matrices:
            out.append({**group, "params": matrices, "muon": True, **extra})
        if rest:
            out.append({**group, "params": rest, "muon": False})
    return out


class MuonAdamW(torch.optim.AdamW):
    """One optimizer: groups marked `muon` take Muon's update (torch.optim.Muon's, with a
    sharded matrix gathered for the Newton-Schulz iteration and this rank's part applied),
    the others AdamW's. One state dict (momentum_buffer beside exp_avg/exp_avg_sq), one
    set of param groups for the schedule."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure(closure)
        groups = self.param_groups
        try:
            self.param_groups = [g for g in groups if not g.get("muon")]
            super().step()
        finally:
            self.param_groups = groups
        for group in groups:
            if group.get("muon"):
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum = float(group["lr"]), group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:  # and a step count, as AdamW's states have (its loading reads it)
                state["step"], state["momentum_buffer"] = torch.tensor(0.0), torch.zeros_like(p.grad)
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            ortho = _zeropower_via_newtonschulz(
                whole(update), (DEFAULT_A, DEFAULT_B, DEFAULT_C), group["ns_steps"], EPS
            )
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(own_part(ortho, p), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
