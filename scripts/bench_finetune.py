"""Per-rank memory of a fine-tune, measured on CPU and planned at 8B and 70B on GPUs:
a full fine-tune, LoRA, QLoRA and adamw8bit on the same 1B-shaped Hugging Face Llama.

    .venv/bin/python scripts/bench_finetune.py --out bench/finetune.md [--steps 3] [--seq 256]

Measured: a TinyLlama-wide LlamaForCausalLM (hidden 2048, 32 heads, 4 KV heads, SwiGLU 5632,
vocabulary 32000; 12 of its 22 layers, 0.66B parameters: the full fine-tune's 16 bytes a
parameter on 2 ranks must fit this 24 GB host beside the loading; 22 layers were killed by
the out-of-memory killer at 11 GiB a rank), random weights, written
by save_pretrained, trained for a few steps on 2 CPU ranks in fp32 (synthetic tokens) under
each setting through the real launcher; each rank's peak RSS (summary.json's
peak_mem_bytes: host memory is all a CPU run has), its model-state bytes (params, grads,
optimizer: the engines' own count) and the planner's model states for the same layout.
Planned: `launcher plan --json` for llama3_8b and llama3_70b at seq 4096 on 80 GB GPUs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=12,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    initializer_range=0.02,
)
CASES = {  # name: (recipe, overrides)
    "full fine-tune, adamw": ("fsdp", []),
    "LoRA r16, adamw": ("fsdp", ["model.lora.rank=16"]),
    "full fine-tune, adamw8bit": ("fsdp", ["optim=adamw8bit"]),
    "QLoRA r16 (nf4 base), adamw": ("ddp", ["model.lora.rank=16", "model.lora.base_dtype=nf4"]),
}
PLANS = {
    "full fine-tune, adamw": [],
    "full fine-tune, adamw8bit": ["optim=adamw8bit"],
    "LoRA r16, adamw": ["model.lora.rank=16"],
    "QLoRA r16 (nf4 base), adamw": ["model.lora.rank=16", "model.lora.base_dtype=nf4"],
}


def write_model(folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def measure(name: str, recipe: str, extra: list[str], model: Path, root: Path, steps: int, seq: int, ac: str) -> dict:
    from launcher import config as C
    from launcher.planner.footprint import model_states
    from launcher.planner.plan import layout_for, planned_model

    run = root / ("".join(c if c.isalnum() else "_" for c in name) + f"_{ac}")
    argv = [
        sys.executable,
        "-m",
        "launcher",
        "train",
        f"hydra.run.dir={run}",
        f"recipe={recipe}",
        "model=hf",
        f"model.pretrained={model}",
        "precision=fp32",
        f"train.steps={steps}",
        "optim.warmup_steps=1",
        f"train.seq_len={seq}",
        "train.micro_batch=1",
        "data.vocab_size=256",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
        "logger=none",
        "logger.log_every=1",
        f"train.activation_checkpointing={ac}",
        *extra,
    ]
    started = time.time()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    cfg = planned_model(C.load_frozen(run))
    planned = sum(model_states(cfg, layout_for(cfg, 2))[:3])
    return {
        "name": name,
        "recipe": recipe,
        "ac": ac,
        "peak": summary["peak_mem_bytes"],
        "states": last["mem/model_state_bytes"],
        "optim": last["mem/optim_bytes"],
        "planned_states": planned,
        "loss": last["loss"],
        "trainable": summary["startup"]["trainable_params"][0],
        "seconds": time.time() - started,
    }


def plan_rows(model: str, gpus: int) -> dict[str, dict]:
    out = {}
    for name, extra in PLANS.items():
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "launcher",
                "plan",
                f"model={model}",
                f"cluster.gpus_per_node={gpus}",
                "cluster.gpu_memory_gb=80",
                "train.seq_len=4096",
                "precision=bf16",
                *extra,
                "--json",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        rows = json.loads(proc.stdout)["rows"]
        best = next((r for r in rows if r["recommended"]), None)
        out[name] = best
    return out


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "finetune.md")
    parser.add_argument("--steps", type=int, default=2, help="2: the optimizer's states exist from the first")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--ac", nargs="+", default=["none", "full"], help="train.activation_checkpointing modes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-finetune-") as tmp:
        root = Path(tmp)
        model = write_model(root / "llama_1b")
        measured = [
            measure(n, r, e, model, root, args.steps, args.seq, ac) for ac in args.ac for n, (r, e) in CASES.items()
        ]
    lines = [
        "# Fine-tuning memory: full, LoRA, QLoRA, adamw8bit",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `scripts/bench_finetune.py` on this project's CPU machine "
        f"(2 cores, no GPU): a TinyLlama-wide LlamaForCausalLM ({SHAPE['num_hidden_layers']} layers, hidden "
        f"{SHAPE['hidden_size']}, 0.66B parameters; 22 layers do not fit this 24 GB host under a full fine-tune) "
        f"written by save_pretrained, 2 ranks, fp32, seq {args.seq}, "
        f"micro-batch 1, {args.steps} steps. Peak = each rank's peak RSS (host memory: a CPU run's only memory, "
        "with the interpreter's and torch's own ~0.4 GiB); states = params + grads + optimizer as the engine "
        "counts them; planned = the planner's model states for the same layout.",
        "",
        "| setting | recipe | checkpointing | trainable | peak GiB/rank | x full | states GiB | x full | planned GiB "
        "| optimizer GiB | s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, m in enumerate(measured):
        full = measured[k - k % len(CASES)]  # the full fine-tune of the same checkpointing mode
        lines.append(
            f"| {m['name']} | {m['recipe']} | {m['ac']} | {m['trainable']:,} | {gib(m['peak'])} "
            f"| {m['peak'] / full['peak']:.3f} | {gib(m['states'])} | {m['states'] / full['states']:.3f} "
            f"| {gib(m['planned_states'])} | {gib(m['optim'])} | {m['seconds']:.0f} |"
        )
    lines += [
        "",
        "Planned on GPUs (`launcher plan --json`, bf16, seq 4096, 80 GB each): the recommended row.",
        "",
        "| model | GPUs | setting | recipe | AC | micro-batch | params | grads | optim | activations | total GiB |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, gpus in (("llama3_8b", 1), ("llama3_8b", 8), ("llama3_70b", 8)):
        for name, row in plan_rows(model, gpus).items():
            if row is None:
                lines.append(f"| {model} | {gpus} | {name} | nothing fits | | | | | | | |")
                continue
            lines.append(
                f"| {model} | {gpus} | {name} | {row['layout']['recipe']} | {row['ac']} | {row['micro_batch']} "
                f"| {gib(row['params'])} | {gib(row['grads'])} | {gib(row['optim'])} | {gib(row['activations'])} "
                f"| {gib(row['total'])} |"
            )
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
