"""kernels.py: draws docs/kernels.png, the picture of docs/kernels.md: the kernels of one layer call
in stream order, one GEMM CTA's warpgroups and pipeline, and a cluster's shared tiles.
Run: python3 docs/figures/kernels.py [out.png]. GEMM box widths are the products' FLOPs for the
dsv3 shape (bench/shapes.py); the other kernels are drawn at a fixed small width, not to scale."""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from shapes import SHAPES, gemm_products  # noqa: E402

GEMM, ROWS, SCHED, SYNC, MMA, TMA = "#4c78a8", "#f58518", "#72b7b2", "#b279a2", "#54a24b", "#9d755d"


def calls(s):
    """The launches of forward and backward at ep = 1, in order, each a list of its steps
    (label, kind, FLOPs): the forward's two run their steps as phases; the backward's kernels
    are a launch each, and the last weight gradient's launch also combines dx (beside it, in
    its idle producer warps)."""
    fwd_g, bwd_g = gemm_products(s)
    gemm = lambda ps: [(n, GEMM, f) for n, f in ps]  # noqa: E731
    fwd = [[("count", SCHED, 0), ("scan", SCHED, 0), ("place", SCHED, 0)],
           [("dispatch x", ROWS, 0)] + gemm(fwd_g) + [("combine", ROWS, 0)]]
    steps = [("saved_open", SYNC, 0), ("dispatch x, dy", ROWS, 0)] + gemm(bwd_g)
    bwd = [[k] for k in steps[:-1]] + [[steps[-1], ("combine", ROWS, 0)],
                                       [("router grad", ROWS, 0)]]
    return fwd, bwd


def timeline(ax, s):
    fwd, bwd = calls(s)
    small = 0.16
    total = sum(g for launch in bwd for _, _, g in launch)
    scale = 7.0 / total   # the backward's GEMMs fill the width
    for y, (name, seq) in [(0.0, ("backward", bwd)), (1.3, ("forward", fwd))]:
        x = 0.0
        for launch in seq:
            x0 = x
            for label, color, g in launch:
                w = g * scale if g else small
                ax.add_patch(Rectangle((x, y), w, 0.7, facecolor=color, edgecolor="white"))
                if label.startswith("shared"):   # too narrow to name: the shared expert's
                    ax.text(x + w / 2, y + 0.35, "shared", ha="center", va="center", fontsize=5,
                            color="white", rotation=90)
                elif w > 0.35:
                    ax.text(x + w / 2, y + 0.35, label, ha="center", va="center", fontsize=7,
                            color="white")
                else:
                    ax.text(x + w / 2, y + 0.75, label, ha="left", va="bottom", rotation=45,
                            fontsize=6)
                x += w
            ax.add_patch(Rectangle((x0, y - 0.05), x - x0, 0.8, fill=False, edgecolor="black",
                                   lw=1.2))
            x += 0.04
        ax.text(-0.1, y + 0.35, name, ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.0, 9.6)
    ax.set_ylim(-0.2, 2.75)
    ax.axis("off")
    ax.set_title(f"a) one call at ep = 1, {s.name} (with a shared expert): its launches (black "
                 "outlines) in order, the forward's two as phases; GEMM widths are FLOPs, the "
                 "other steps are not to scale", fontsize=8, loc="left")
    for i, (c, t) in enumerate([(SCHED, "schedule"), (ROWS, "row movement"), (GEMM, "GEMM"),
                                (SYNC, "saved check")]):
        ax.add_patch(Rectangle((4.6 + 1.25 * i, 2.55), 0.15, 0.14, facecolor=c))
        ax.text(4.8 + 1.25 * i, 2.62, t, fontsize=7, va="center")


def box(ax, x, y, w, h, text, color, fs=7, tc="white"):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="white"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs, color=tc)


def arrow(ax, a, b, text="", color="black"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=8, color=color, lw=0.8))
    if text:
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.08, text, fontsize=6, ha="center")


def cta(ax):
    box(ax, 0.0, 2.2, 1.6, 0.8, "warpgroup 0: producer\nthread 0 issues TMA\n(40 registers)", TMA)
    for s in range(4):
        box(ax, 2.2 + 0.75 * s, 1.9, 0.65, 0.5, f"B {s}\n32 KB", GEMM, 6)
        box(ax, 2.2 + 0.75 * s, 2.45, 0.65, 0.35, f"A {s}\n16 KB", GEMM, 6)
        ax.text(2.52 + 0.75 * s, 2.88, "full / empty", fontsize=5, ha="center")
    ax.text(3.7, 3.1, "4 stages of shared memory (128B swizzle), one k-block (64) each", fontsize=7,
            ha="center")
    arrow(ax, (1.6, 2.6), (2.2, 2.6), "TMA")
    for w in range(2):
        y = 1.0 - 0.85 * w
        box(ax, 1.7, y, 3.6, 0.6, f"warpgroup {w + 1}: rows {64 * w}-{64 * w + 63} x 256 columns\n"
            "wgmma m64n256k16, 128 fp32 accumulators\nper thread (232 registers)", MMA, 6)
        box(ax, 5.6, y, 1.3, 0.6, "epilogue from\nregisters to global", TMA, 6)
        arrow(ax, (5.3, y + 0.3), (5.6, y + 0.3))
    arrow(ax, (2.9, 1.9), (2.9, 1.6))
    ax.text(3.0, 1.72, "both read A rows of their half and all of B", fontsize=6)
    ax.text(0.0, 0.35, "persistent:\nCTAs take blocks\nof tiles in turn,\n16 M tiles per\n"
            "group, M first", fontsize=7, va="center")
    ax.set_xlim(-0.1, 7.0)
    ax.set_ylim(-0.1, 3.3)
    ax.axis("off")
    ax.set_title("b) one GEMM CTA (src/cuda/gemm.cuh)", fontsize=9, loc="left")


def cluster(ax):
    for n in range(2):
        for m in range(2):
            r = m + 2 * n
            box(ax, 1.2 + 1.3 * n, 1.6 - 1.0 * m, 1.2, 0.9,
                f"CTA {r}\nM tile 2mb+{m}\nN tile 2nb+{n}", GEMM, 7)
    ax.annotate("", xy=(1.1, 0.6), xytext=(1.1, 2.5),
                arrowprops=dict(arrowstyle="<->", color=SCHED, lw=1.5))
    ax.text(1.0, 1.55, "same N column:\nB multicast\n(same expert)", fontsize=7, ha="right",
            va="center")
    ax.annotate("", xy=(1.15, 0.35), xytext=(3.75, 0.35),
                arrowprops=dict(arrowstyle="<->", color=ROWS, lw=1.5))
    ax.text(2.45, 0.05, "same M row: A multicast (cn = 2)", fontsize=7, ha="center")
    ax.text(4.0, 1.6, "a cluster of 2 x cn CTAs\ntakes a block of 2 x cn tiles;\nevery stage is "
            "released in\nevery CTA, so they walk\nthe k-loop in step\n(a CTA with no tile: "
            "phantom)\n\nby default 2 x 1 (cn = 1);\n2 x 2 by the context's\ncluster knob",
            fontsize=7, va="center")
    ax.set_xlim(0, 6.5)
    ax.set_ylim(-0.1, 2.8)
    ax.axis("off")
    ax.set_title("c) a cluster of 2 x 2 (cn = 2)", fontsize=9, loc="left")


def main(out):
    s = next(x for x in SHAPES if x.name == "dsv3")
    fig = plt.figure(figsize=(11, 7.5))
    timeline(fig.add_axes([0.02, 0.66, 0.96, 0.3]), s)
    cta(fig.add_axes([0.02, 0.02, 0.55, 0.58]))
    cluster(fig.add_axes([0.58, 0.05, 0.41, 0.5]))
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1] / "kernels.png"))
