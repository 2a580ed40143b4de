"""Plain-text tables for the terminal."""

from __future__ import annotations


def rmse_table(rmse: dict) -> str:
    lines = [f"{'layer':>5} {'bits':>4} {'gate':>10} {'up':>10} {'down':>10} {'max|err|':>10}"]
    for r in rmse["layers"]:
        mx = max(r["max_abs"].values())
        lines.append(f"{r['layer']:>5} {r['bits']:>4} {r['gate']:>10.6f} {r['up']:>10.6f} {r['down']:>10.6f} {mx:>10.6f}")
    o = rmse["overall"]
    lines.append(f"{'mean':>5} {'':>4} {o['gate']:>10.6f} {o['up']:>10.6f} {o['down']:>10.6f}")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"  # pragma: no cover
