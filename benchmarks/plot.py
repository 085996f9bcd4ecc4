"""Bar chart of a benchmarks.run JSON: µs per path and fraction of the floor, per shape.

Usage: python -m benchmarks.plot results.json chart.png   (needs matplotlib)
"""

import json
import sys


def main(argv=None):
    argv = argv if argv is not None else sys.argv[1:]
    src, dst = argv
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(src))
    rows = data["rows"]
    paths = [k for k in rows[0] if k != "limit" and isinstance(rows[0][k], dict) and "us" in rows[0][k]]
    labels = [f"{r['shape']}\npad={r['token_padding']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, 1.3 * len(rows)), 5))
    width = 0.8 / (len(paths) + 1)
    xs = range(len(rows))
    for i, p in enumerate(paths):
        eff = [r[p]["eff"] for r in rows]
        bars = ax.bar([x + i * width for x in xs], eff, width, label=p)
        for bar, r in zip(bars, rows):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01, f"{r[p]['us']:.0f}",
                    ha="center", va="bottom", fontsize=6, rotation=90)
    ax.axhline(0.8, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks([x + width * (len(paths) - 1) / 2 for x in xs])
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_ylabel("fraction of the floor (higher is better); bar labels: µs")
    ax.set_ylim(0, 1.1)
    env = data["env"]
    ax.set_title(f"MoonEP expert path, CUDA-graph replay — {env['gpu']}, torch {env['torch']}, "
                 f"triton {env['triton']}, {env['date']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=130)


if __name__ == "__main__":
    main()
