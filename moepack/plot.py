"""Optional plots (matplotlib, the `plot` extra)."""

from __future__ import annotations

from .errors import MoepackError


def plot_rmse(res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MoepackError("--plot needs matplotlib", hint="pip install 'moepack[plot]'") from None
    layers = [r["layer"] for r in res["layers"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    for proj in ("gate", "up", "down"):
        ax.plot(layers, [r[proj] for r in res["layers"]], marker="o", ms=3, label=proj)
    ax.set_xlabel("layer")
    ax.set_ylabel("RMSE vs source")
    ax.set_title("routed-expert requantization error")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
