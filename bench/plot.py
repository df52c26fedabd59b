"""One PNG summarising a run: speed ratios, time to first token against history,
swap cost against history, and per-token dispatch cost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a server
import matplotlib.pyplot as plt


def _ratios(ax: plt.Axes, families: dict[str, Any]) -> None:
    labels, prefill, decode = [], [], []
    for family, res in families.items():
        for size, f in res.get("forward", {}).items():
            labels.append(f"{family}\n{size}")
            prefill.append(f["prefill_ratio_vs_mlx_lm"])
            decode.append(f["decode_ratio_vs_mlx_lm"])
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], prefill, 0.4, label="prefill")
    ax.bar([x + 0.2 for x in xs], decode, 0.4, label="decode")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("turbospark ÷ mlx-lm (tok/s)")
    ax.set_title("Forward speed, same install and loop")
    ax.legend()


def _ttft(ax: plt.Axes, family: str, res: dict[str, Any]) -> None:
    series: list[tuple[str, list[dict[str, Any]]]] = []
    if inter := res.get("interleaved"):
        series += [
            (f"in process, {inter['conversations']} slots", inter["pool"]["turns"]),
            ("in process, 1 slot", inter["no_pool"]["turns"]),
        ]
    if serving := res.get("serving"):
        series += [
            ("turbospark serve", serving["turbospark"]["turns"]),
            ("mlx_lm.server", serving["mlx_lm"]["turns"]),
        ]
    for label, turns in series:
        ax.plot(
            [t["prompt_tokens"] for t in turns],
            [t["ttft_s"] * 1e3 for t in turns],
            marker="o",
            linestyle="none",
            label=label,
        )
    ax.set_xlabel("prompt tokens (history + new turn)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"{family}: interleaved chats")
    ax.legend(fontsize=7)


def _swap(ax: plt.Axes, families: dict[str, Any]) -> None:
    for i, (family, res) in enumerate(families.items()):
        if not (swap := res.get("swap")):
            continue
        rows, color = swap["rows"], f"C{i}"  # one colour per family, one line style per series
        xs = [r["history_tokens"] for r in rows]
        ax.plot(xs, [r["swap_ms"] for r in rows], marker="o", color=color,
                label=f"{family}: pool swap")  # fmt: skip
        ax.plot(xs, [r["reprefill_ms"] for r in rows], marker="x", linestyle="--", color=color,
                label=f"{family}: re-prefill (no pool)")  # fmt: skip
        if "mlx_lm_cache_hit_ms" in rows[0]:
            ax.plot(xs, [r["mlx_lm_cache_hit_ms"] for r in rows], marker="s", linestyle=":",
                    color=color, label=f"{family}: mlx-lm cache hit")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("history tokens")
    ax.set_ylabel("ms")
    ax.set_title("Switching conversations")
    ax.legend(fontsize=7)


def _dispatch(ax: plt.Axes, families: dict[str, Any]) -> None:
    paths = ("direct", "hook", "runner")
    names = [f for f, res in families.items() if "dispatch" in res]
    for i, family in enumerate(names):
        us = families[family]["dispatch"]["per_token_us"]
        ax.bar([p + i * 0.4 for p in range(3)], [us[p] for p in paths], 0.4, label=family)
    ax.set_xticks([p + 0.2 * (len(names) - 1) for p in range(3)], paths)
    ax.set_ylabel("µs per decoded token (tiny model)")
    ax.set_title("Dispatch path")
    ax.legend()


def plot(report: dict[str, Any], path: Path) -> None:
    families = report["families"]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    _ratios(axes[0][0], families)
    chat_axes = [axes[0][1], axes[0][2]]
    for ax, (family, res) in zip(chat_axes, families.items(), strict=False):
        _ttft(ax, family, res)
    for ax in chat_axes[len(families) :]:
        ax.axis("off")
    _swap(axes[1][0], families)
    _dispatch(axes[1][1], families)
    m = report["machine"]
    axes[1][2].axis("off")
    axes[1][2].text(
        0.0,
        0.9,
        f"{m['cpu_model']}\n{m['cores']} cores, {m['device']}\n{m['blas']}\n"
        f"mlx {m['mlx']}, mlx-lm {m['mlx_lm']}\ndtype {report['dtype']}, {report['mode']} run",
        va="top",
        fontsize=9,
        wrap=True,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
