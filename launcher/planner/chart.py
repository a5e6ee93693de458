"""`make plan --chart`: the plan's rows as stacked bars, one per layout (plan.py computes them)."""

from __future__ import annotations

from pathlib import Path

from launcher.planner.plan import GiB, Hardware, Row


def chart_rows(rows: list[Row]) -> list[Row]:
    """One row per layout, at its best checkpointing mode: ★, else the cheapest that fits,
    else the smallest peak (the table has every mode)."""
    best: dict[str, Row] = {}
    for r in rows:
        b = best.get(r.layout.label)
        key = lambda x: (not x.recommended, not x.fits, x.cost if x.fits else x.peak)  # noqa: E731
        if b is None or key(r) < key(b):
            best[r.layout.label] = r
    return list(best.values())


def _cut_bars(ax, rows: list[Row], hw: Hardware) -> float:
    """The axis' end, so that the memory lines stay in sight: a bar far beyond them is cut there,
    its size written at the cut."""
    end = max(hw.gpu_bytes, min(max(r.peak for r in rows), 2 * hw.gpu_bytes)) / GiB * 1.05
    for i, r in enumerate(rows):
        if max(r.total, r.startup) / GiB > end:
            ax.text(
                end,
                i,
                f"{r.peak / GiB:,.0f} GiB ▸",
                ha="right",
                va="center",
                fontsize=8,
                bbox=dict(facecolor="white", edgecolor="none", pad=1),
            )
    return end


def chart(rows: list[Row], hw: Hardware, path: Path, reserve_gb: float, title: str = "") -> None:
    """Stacked horizontal bars, one per layout (chart_rows), against the memory lines; about
    1200 pixels wide and 1 + 0.3 inch per layout high at any cluster size."""
    import matplotlib  # local: order (the Agg backend is chosen when drawing, not when imported)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # local: order (after matplotlib.use("Agg"))

    rows = chart_rows(rows)
    labels = [
        f"{'★ ' if r.recommended else '' if r.fits else '✗ '}{r.layout.label}, AC {r.ac.value}, "
        f"{f'micro-batch {r.micro_batch}' if r.fits else 'does not fit'}"
        for r in rows
    ]
    # stacked as Row.total adds them: the gradients kept beside the activations, and what
    # their own peak (the end of backward, the update) needs beyond the activations
    parts = [
        ("params", lambda r: r.params - r.host.get("params", 0)),
        ("optim", lambda r: r.optim - r.host.get("optim", 0)),
        ("grads beside the activations", lambda r: r.grads_split[0]),
        ("activations", lambda r: r.activations),
        ("grads at their peak, beyond", lambda r: r.grads_split[1]),
        ("temp", lambda r: r.temp),
    ]
    fig, ax = plt.subplots(figsize=(10, 2.2 + 0.3 * len(rows)), layout="constrained")
    left = [0.0] * len(rows)
    for name, get in parts:
        values = [get(r) / GiB for r in rows]
        ax.barh(range(len(rows)), values, left=left, label=name, height=0.7)
        left = [a + b for a, b in zip(left, values)]
    ax.scatter(
        [r.startup / GiB for r in rows],
        range(len(rows)),
        marker="|",
        s=300,
        color="black",
        zorder=3,
        label="start-up (before step 1)",
    )
    ax.axvline(hw.gpu_bytes / GiB, color="red", linestyle="--", label=f"{hw.unit} memory")
    ax.axvline(
        hw.gpu_bytes / GiB - reserve_gb, color="red", linestyle=":", label=f"less plan.reserve_gb ({reserve_gb:g} GiB)"
    )
    end = _cut_bars(ax, rows, hw)
    ax.set_xlim(0, end)
    ax.set_yticks(range(len(rows)), labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel(f"GiB per {hw.unit}")
    ax.set_title(
        f"{title}\neach layout at its best activation checkpointing (`make plan` lists every mode)",
        fontsize=10,
        loc="left",
    )
    fig.legend(loc="outside lower center", ncols=4, fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
