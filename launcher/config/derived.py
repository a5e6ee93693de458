"""Figures derived from a config alone, shared by the launch side and the ranks: the FFN
width, the pipeline's stage count, the processes per node. The degrees and the batch
arithmetic need the recipe's engine (what it may split): launcher/parallel/degrees.py.
"""

from __future__ import annotations


from launcher.config.enums import PPSchedule
from launcher.config.recipe import ParallelConfig
from launcher.config.model import ModelConfig
from launcher.config.root import Config


def ffn_dim(m: ModelConfig) -> int:
    if m.ffn_dim is not None:
        return m.ffn_dim
    hidden = int(8 * m.dim / 3)
    return m.multiple_of * ((hidden + m.multiple_of - 1) // m.multiple_of)


def pipeline_stages(p: ParallelConfig) -> int:
    """Pipeline stages in all: pp, times the stages per rank of an interleaved schedule."""
    return p.pp * (p.pp_virtual_stages if p.pp_schedule == PPSchedule["interleaved_1f1b"] else 1)


def nproc_per_node(cfg: Config, host) -> int:
    c = cfg.cluster
    if c.nproc_per_node is not None:
        return c.nproc_per_node
    if c.gpus_per_node is not None:
        return c.gpus_per_node
    return host.gpus if host.cuda else 2
