"""Which rank holds the others back (train.straggler_factor).

Under synchronous collectives every rank's step takes the same wall time: the fast ranks
wait inside a collective for the slow one (DDP's bucket all-reduce, FSDP's and ZeRO-3's
parameter all-gathers, a pipeline's receive). A rank's own speed shows in its work outside
those waits. On a log step each rank times the step's first forward over its leaf modules
that hold parameters (the linears, embeddings and norms: most of the FLOPs) from just
after their pre-forward hooks (where FSDP2 and ZeRO-3 wait for their gathered parameters,
and where an input still in flight from a tensor-parallel collective is waited for) to
the end of their forward, adds the step's data wait, and all ranks gather these (one
all-gather of three floats).
Each rank is compared with the median of the other ranks doing the same work (its pipeline
stage); the slowest and its lag go to metrics.jsonl and W&B every log step, and one console
line names it (rank, host) when it is above train.straggler_factor x that median.

On CUDA the spans are CUDA events (read at the log step, which synchronises anyway); on
the host, the clock. Other steps pay nothing: the hooks exist only during log steps, and
time only the step's first forward (one span per layer; later calls return at once). With
train.compile the blocks are compiled with their hooks, so the span is the whole forward
(which holds FSDP's and ZeRO-3's waits: there only a slow data loader or a ddp/zero1/2
rank is told apart)."""

from __future__ import annotations

import contextlib
import socket
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from launcher.parallel.degrees import degrees
from launcher.rank.engine import parameter_leaves


def timed_modules(engine, compiled: bool) -> list[torch.nn.Module]:
    """The modules whose forward is timed: leaves that hold parameters, or (compiled) each
    module the step calls whole: the model unwrapped from DDP, or a pipeline's stages."""
    # a pipeline calls its stages, never the model; DDP wraps the model (`module` inside)
    roots = [s.submod for s in engine.stages] or [getattr(engine.model, "module", engine.model)]
    return roots if compiled else [m for root in roots for m in parameter_leaves(root)]


def _settle_inputs(args) -> None:
    """Wait for inputs still in flight from a functional collective (a tensor-parallel
    all-gather): the module's first op would wait for them; here the span starts after."""
    for a in args:
        local = getattr(a, "_local_tensor", a)  # a DTensor's local shard
        if isinstance(local, AsyncCollectiveTensor):
            local.trigger_wait()


class Stragglers:
    """Per-rank compute and data time on log steps, gathered and compared."""

    def __init__(self, cfg, engine, device: torch.device, rank: int, world_size: int, say):
        self.factor, self.rank, self.world, self.say, self.device = (
            cfg.train.straggler_factor,
            rank,
            world_size,
            say,
            device,
        )
        d = degrees(cfg, world_size)
        self.on = bool(self.factor) and world_size > d.pp  # some stage has two ranks to compare
        self.stage = d.coords(rank)[0]
        self.modules = timed_modules(engine, cfg.train.compile) if self.on else []
        self.hosts = [None] * world_size
        if self.on:  # once: which host each rank runs on, for the console line
            dist.all_gather_object(self.hosts, socket.gethostname())
        self.spans: list = []
        self.data_s = 0.0
        self.armed = False
        self.first = True  # a launch's first step holds one-time work (lazy init, warm-up) that differs by rank

    @contextlib.contextmanager
    def timed(self, logged: bool, data_s: float):
        """Around the step: on a log step, time the forward spans of the timed modules (never
        on the launch's first step)."""
        first, self.first = self.first, False
        if not (self.on and logged) or first:
            yield
            return
        self.spans, self.data_s, self.armed = [], data_s, True
        cuda = self.device.type == "cuda"

        def start(_module, args):
            if len(self.spans) >= len(self.modules):  # one forward's worth measured: the rest pays a call
                return
            _settle_inputs(args)
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.spans.append([event, None])
            else:
                self.spans.append([time.perf_counter(), None])

        def end(_module, _args, _output):
            if not self.spans or self.spans[-1][1] is not None:
                return
            span = self.spans[-1]
            if cuda:
                span[1] = torch.cuda.Event(enable_timing=True)
                span[1].record()
            else:
                span[1] = time.perf_counter()

        handles = [h for m in self.modules for h in (m.register_forward_pre_hook(start), m.register_forward_hook(end))]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def compute_s(self) -> float:
        """This rank's timed forward spans of the last log step, in seconds."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return sum(a.elapsed_time(b) for a, b in self.spans if b is not None) / 1000
        return sum(b - a for a, b in self.spans if b is not None)

    def report(self, step: int) -> dict:
        """At a log step, on every rank (one all-gather): the slowest rank's figures for
        the log; a console line on rank 0 when it is a straggler. {} when not measured."""
        if not self.armed:
            return {}
        self.armed = False
        mine = torch.tensor([self.compute_s(), self.data_s, float(self.stage)], dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        if self.rank != 0:
            return {}
        rows = [g.tolist() for g in gathered]
        verdict = slowest(rows)
        if verdict is None:
            return {}
        r, work, median = verdict
        ratio = work / median if median > 0 else float("inf")
        peers = sum(row[2] == rows[r][2] for row in rows) - 1
        if ratio > self.factor:
            self.say(
                f"straggler: rank {r} (host {self.hosts[r]}) at step {step}: {work * 1e3:,.1f} ms of forward "
                f"compute and data wait, {ratio:.2f}x the median {median * 1e3:,.1f} ms of the {peers} other "
                f"rank(s) doing its work (train.straggler_factor={self.factor:g})"
            )
        return {
            "rank/slowest": r,
            "rank/slowest_lag_s": work - median,
            "rank/slowest_ratio": ratio,
            "rank/compute_s_median": statistics.median(row[0] for row in rows),
            "rank/compute_s_max": max(row[0] for row in rows),
            "rank/data_s_max": max(row[1] for row in rows),
        }


def slowest(rows: list[list[float]]) -> tuple[int, float, float] | None:
    """(rank, its work, the median of the other ranks' work in its pipeline stage) for the
    rank furthest above that median; rows are (compute_s, data_s, stage) by rank. The
    others only: with two ranks a rank 2x slower reads 2x, not 2/1.5x. None when no stage
    has two ranks to compare."""
    by_stage: dict[float, list[tuple[int, float]]] = {}
    for r, (compute, data, stage) in enumerate(rows):
        by_stage.setdefault(stage, []).append((r, compute + data))
    best = None
    for ranks in by_stage.values():
        if len(ranks) < 2:
            continue
        ordered = sorted(w for _, w in ranks)
        for r, work in ranks:
            others = list(ordered)
            others.remove(work)
            median = statistics.median(others)
            ratio = work / median if median > 0 else float("inf")
            if best is None or ratio > best[0]:
                best = (ratio, r, work, median)
    return None if best is None else best[1:]
