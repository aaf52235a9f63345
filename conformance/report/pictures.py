"""The report's pictures: causal masks, the worked example's weights, agreement heatmaps.

Drawn with matplotlib on the file-only Agg backend, imported only here and only when the
pictures are drawn (``pip install attention-conformance[report]``); without it the report
says the pictures were skipped.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from conformance.backends import load_backend
from conformance.report.agreement import names_in
from conformance.suite.cases import worked_example


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, imported only for the pictures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _weights(backend, q, k, **options) -> np.ndarray:
    """Run attention with V = identity: the output is the weight matrix (B, H, T, S)."""
    B, K, S, _ = k.shape
    eye = np.broadcast_to(np.eye(S), (B, K, S, S)).copy()
    return backend.attention(q, k, eye, **options)


#: The masks drawn: (title, T, S, options). Each is drawn by running attention with
#: q = k = 0 (equal scores) and V = identity, so a cell is 1/n on the n keys a query sees.
MASK_PICTURES = [
    ("causal, top-left (T=5, S=8)", 5, 8, {"is_causal": True}),
    (
        "causal, bottom-right (T=5, S=8)",
        5,
        8,
        {"is_causal": True, "causal_alignment": "bottom_right"},
    ),
    (
        "causal, bottom-right (T=8, S=5)",
        8,
        5,
        {"is_causal": True, "causal_alignment": "bottom_right"},
    ),
    ("window (2, 1) (T=S=8)", 8, 8, {"window": (2, 1)}),
    ("causal + window (2, 0) (T=S=8)", 8, 8, {"is_causal": True, "window": (2, 0)}),
]


def draw_masks(path: Path, backend_name: str = "numpy") -> None:
    plt = _pyplot()
    backend = load_backend(backend_name)
    columns = 3
    rows = -(-len(MASK_PICTURES) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.4 * columns, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(MASK_PICTURES) :]:
        ax.axis("off")
    for ax, (title, T, S, options) in zip(axes.flat, MASK_PICTURES):
        q, k = np.zeros((1, 1, T, 1)), np.zeros((1, 1, S, 1))
        w = _weights(backend, q, k, **options)[0, 0]  # (T, S)
        ax.imshow(w > 0, cmap="Blues", vmin=0, vmax=1.4)
        for t in range(T):
            for s in range(S):
                if w[t, s] > 0:
                    ax.text(s, t, f"1/{round(1 / w[t, s])}", ha="center", va="center", fontsize=7)
            if not (w[t] > 0).any():
                ax.text(
                    S / 2 - 0.5,
                    t,
                    "no key: output 0",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="firebrick",
                )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key s")
        ax.set_ylabel("query t")
        ax.set_xticks(range(S))
        ax.set_yticks(range(T))
        ax.set_xticks(np.arange(-0.5, S), minor=True)
        ax.set_yticks(np.arange(-0.5, T), minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
    fig.suptitle(
        f"Which keys each query attends (weights with equal scores, run on the {backend_name} backend)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_worked_example(path: Path, backend_name: str = "numpy") -> None:
    plt = _pyplot()
    backend = load_backend(backend_name)
    ex = worked_example()
    q, k, v = (np.array(ex[n], dtype=np.float64)[None, None] for n in "qkv")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    for ax, causal in zip(axes, (True, False)):
        w = _weights(backend, q, k, is_causal=causal)[0, 0]  # (T, S)
        out = backend.attention(q, k, v, is_causal=causal)[0, 0]  # (T, E)
        ax.imshow(w, cmap="viridis", vmin=0, vmax=1)
        for t in range(w.shape[0]):
            for s in range(w.shape[1]):
                ax.text(
                    s,
                    t,
                    f"{w[t, s]:.2f}",
                    ha="center",
                    va="center",
                    color="w" if w[t, s] < 0.6 else "k",
                )
        rows = ", ".join("[" + ", ".join(f"{x:.2f}" for x in row) + "]" for row in out)
        ax.set_title(f"{'causal' if causal else 'non-causal'}: out = [{rows}]", fontsize=9)
        ax.set_xlabel("key s")
        ax.set_ylabel("query t")
        ax.set_xticks(range(w.shape[1]))
        ax.set_yticks(range(w.shape[0]))
    fig.suptitle(
        "The seed's worked example: attention weights (Q, K, V in fixtures/worked_example.json)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: The heatmaps' one colour scale, for every dtype and quantity: the fraction of the
#: tolerance from 0 (white) to 1 (dark blue); beyond 1, where the test fails, red; grey
#: where nothing was compared.
FAILS_COLOUR = (0.84, 0.15, 0.16, 1.0)
NOT_COMPARED_COLOUR = (0.88, 0.88, 0.88, 1.0)


def cell_colours(grid: np.ndarray) -> np.ndarray:
    """RGBA (n, n, 4) for a grid of fractions of the tolerance (NaN: not compared)."""
    from matplotlib import colormaps

    blues = colormaps["Blues"]
    colours = blues(np.clip(np.nan_to_num(grid, nan=0.0, posinf=2.0), 0.0, 1.0))
    colours[grid > 1] = FAILS_COLOUR
    colours[np.isnan(grid)] = NOT_COMPARED_COLOUR
    return colours


def heatmap_grid(block: dict) -> tuple[list[str], np.ndarray]:
    """The backends, and the fractions of the tolerance: diagonal against the oracle,
    off the diagonal each pair (symmetric), NaN where nothing was compared. Where no pair
    was compared at all (float16 and bfloat16: the pairwise tests draw float64 and float32
    inputs), one row: each backend against the oracle, and no cell of pairs never compared."""
    names = names_in(block)
    if not block["pairs"]:
        row = [block["vs_oracle"][a]["fraction_of_tolerance"] for a in names]
        return names, np.array([row], dtype=float)
    grid = np.full((len(names), len(names)), np.nan)
    for i, a in enumerate(names):
        if a in block["vs_oracle"]:
            grid[i, i] = block["vs_oracle"][a]["fraction_of_tolerance"]
        for j, b in enumerate(names):
            pair = block["pairs"].get(f"{a}~{b}") or block["pairs"].get(f"{b}~{a}")
            if i != j and pair is not None:
                grid[i, j] = pair["fraction_of_tolerance"]
    return names, grid


def draw_heatmap(path: Path, dtype: str, block: dict, what: str = "outputs") -> None:
    """Each backend's worst error as a fraction of the tolerance its test applied: the
    diagonal against the oracle on the fixtures, off the diagonal each pair against each
    other on random inputs (SPEC §7.3, §12.10), on the one scale of ``cell_colours``."""
    plt = _pyplot()
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    names, grid = heatmap_grid(block)
    rows, n = grid.shape
    fig, ax = plt.subplots(figsize=(1.5 * n + 3.2, 1.15 * rows + 2.2 + 0.6 * (rows == 1)))
    ax.imshow(cell_colours(grid))
    for i in range(rows):
        for j in range(n):
            x = grid[i, j]
            if math.isnan(x):
                text, color = "not\ncompared", "dimgray"
            else:
                text = "inf" if math.isinf(x) else f"{x:.2g}"
                text += "\nFAILS" if x > 1 else ""
                color = "w" if x > 0.55 else "k"
            ax.text(j, i, text, ha="center", va="center", color=color, fontsize=8)
    ax.set_xticks(range(n), names, rotation=30, ha="right")
    ax.set_yticks(range(rows), names if rows == n and rows > 1 else ["vs the oracle"])
    cmap = plt.get_cmap("Blues").copy()
    cmap.set_over(FAILS_COLOUR)
    scale = ScalarMappable(Normalize(0.0, 1.0), cmap)
    fig.colorbar(scale, ax=ax, extend="max", label="max error / tolerance (red: > 1, fails)")
    how = (
        "(diagonal: vs the oracle on the fixtures; off-diagonal: pairs on random inputs)"
        if block["pairs"]
        else "(vs the oracle on the fixtures; no pair is compared in this dtype)"
    )
    ax.set_title(f"{dtype} {what}: worst error as a fraction of the tolerance\n{how}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_pictures(out: Path, agreement: dict) -> dict[str, str]:
    """Every picture of the report: {name: file name}, or {"error": why} without matplotlib."""
    try:
        _pyplot()
    except ImportError as err:
        return {
            "error": f"no pictures: matplotlib is not installed ({err}); pip install matplotlib"
        }
    files = {"masks": "masks.png", "worked_example": "worked-example-weights.png"}
    draw_masks(out / files["masks"])
    draw_worked_example(out / files["worked_example"])
    prefixes = {"outputs": "agreement", "gradients": "gradient-agreement"}
    for quantity, by_dtype in agreement.items():
        for dtype, block in by_dtype.items():
            if heatmap_grid(block)[1].size < 2:  # one cell: the table says it all
                continue
            key = f"{prefixes[quantity]}-{dtype}"
            files[key] = f"{key}.png"
            draw_heatmap(out / files[key], dtype, block, quantity)
    return files
