"""PNG plots of a benchmark summary (matplotlib, Agg backend, no display needed)."""

from __future__ import annotations

from pathlib import Path

from .spec import BASELINE, OVERALL


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(summary: dict, path: Path) -> Path | None:
    """Grouped bars: geometric-mean speedup over AR per category (and overall), one bar per method."""
    methods = {k: v for k, v in summary["methods"].items() if k != BASELINE}
    if not methods:
        return None
    plt = _pyplot()
    cats = list(summary["categories"]) + [OVERALL]
    n = len(methods)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.4, len(cats) * n * 0.32 + 2)), 5.0))
    for i, (label, m) in enumerate(methods.items()):
        values = [(m if c == OVERALL else m["categories"].get(c, {})).get("speedup_geomean") for c in cats]
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(cats))]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, heights, width * 0.95, label=label + (" (peer)" if m.get("kind") == "peer" else ""),
                      hatch="//" if m.get("kind") == "peer" else None, edgecolor="white", linewidth=0.5)
        if n * len(cats) <= 56:
            for bar, v in zip(bars, values, strict=False):
                if v is not None:
                    ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                                fontsize=7 if n * len(cats) <= 24 else 5.5, xytext=(0, 1),
                                textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="AR (1.0×)")
    ax.set_xticks(range(len(cats)))
    tilt = len(cats) > 8
    ax.set_xticklabels(cats, rotation=20 if tilt else 0, ha="right" if tilt else "center")
    ax.set_ylabel("speedup over AR (geometric mean)")
    p = summary.get("parameters", {})
    ax.set_title(f"{p.get('model')}: speedup per category (max {p.get('max_new_tokens')} new tokens, "
                 f"T={p.get('temperature')})", fontsize=10)
    ax.set_ylim(0, max(1.2, ax.get_ylim()[1] * 1.08))
    ax.legend(fontsize=8, ncol=min(4, n + 1), loc="upper center", bbox_to_anchor=(0.5, -0.22 if tilt else -0.08),
              frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_acceptance(summary: dict, path: Path, max_depth: int = 16) -> Path | None:
    """Acceptance rate by draft depth, one line per method that drafts."""
    methods = {k: v for k, v in summary["methods"].items() if v.get("acceptance_by_depth")}
    if not methods:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, m in methods.items():
        alpha = m["acceptance_by_depth"][:max_depth]
        ax.plot(range(1, len(alpha) + 1), alpha, marker="o", markersize=3, label=f"{label} (τ={m['tau']:.2f})")
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("acceptance rate at depth d")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance rate by draft depth (all questions)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(summary: dict, out_dir: Path) -> list[str]:
    out_dir = Path(out_dir)
    files = [plot_speedup(summary, out_dir / "speedup_by_category.png"),
             plot_acceptance(summary, out_dir / "acceptance_by_depth.png")]
    return [str(f) for f in files if f is not None]
