"""Tables (terminal and Markdown), ratios gateway / peer, PNG plots and docs/BENCHMARKS.md."""

from __future__ import annotations

import math
import os
from string import Template

import matplotlib

matplotlib.use("Agg")  # files only; no display on a server
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "benchmarks_template.md")

# (header, row key, format): one list serves the terminal and the Markdown table.
COLUMNS = (
    ("system", "system", "{}"),
    ("conv", "conversations", "{}"),
    ("turns", "turns", "{}"),
    ("err", "errors", "{}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
    ("added TTFT p50", "added_ttft_p50_ms", "{:.1f}"),
    ("added TTFT p99", "added_ttft_p99_ms", "{:.0f}"),
    ("added ITL ms", "added_itl_ms", "{:.2f}"),
    ("turns/s", "turns_per_s", "{:.1f}"),
    ("events/s/core", "events_per_core_s", "{:.0f}"),
    ("CPU ms/turn", "cpu_ms_per_turn", "{:.2f}"),
    ("computed/ideal", "computed_over_ideal", "{:.2f}"),
    ("D pulled/turn", "pulled_per_turn", "{:.0f}"),
    ("P hits", "hit_rate", "{:.0%}"),
    ("client CPU", "client_core_share", "{:.0%}"),
    ("machine busy", "machine_busy", "{:.0%}"),
)
# Ratios gateway / peer: below 1 is better for the times and CPU, above 1 for the rates.
RATIOS = (
    ("TTFT p50", "ttft_p50_ms"),
    ("TTFT p99", "ttft_p99_ms"),
    ("added TTFT p50", "added_ttft_p50_ms"),
    ("turns/s", "turns_per_s"),
    ("CPU/turn", "cpu_ms_per_turn"),
    ("events/s/core", "events_per_core_s"),
)


def cell(fmt: str, value: object) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "–"
    return fmt.format(value)


def table(rows: list[dict], columns=COLUMNS, markdown: bool = False) -> str:
    header = [c[0] for c in columns]
    body = [[cell(fmt, row.get(key)) for _, key, fmt in columns] for row in rows]
    if markdown:
        lines = [header, ["---"] * len(header), *body]
        return "\n".join("| " + " | ".join(line) + " |" for line in lines)
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join(
        "  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in [header, *body]
    )


def ratios(rows: list[dict], systems) -> list[dict]:
    """Gateway / peer for every gateway configuration at every concurrency, the peers being the
    seed and vllm-router.

    Each gateway run is compared with the seed run of the same ids setting, else the one with ids,
    and with the first vllm-router configuration (it ignores ids).
    """
    seeds = {s.ids: s.label for s in systems if s.kind == "seed"}
    routers = [s.label for s in systems if s.kind == "router"][:1]  # its default configuration
    by_key = {(r["system"], r["conversations"]): r for r in rows}
    out = []
    for system in (s for s in systems if s.kind == "gateway"):
        for peer in filter(None, (seeds.get(system.ids) or seeds.get(True), *routers)):
            for r in (r for r in rows if r["system"] == system.label):
                base = by_key.get((peer, r["conversations"]))
                if base is None:
                    continue
                ratio = {"system": f"{system.label} / {peer}", "conversations": r["conversations"]}
                for name, key in RATIOS:
                    ratio[name] = r[key] / base[key] if base[key] else float("nan")
                out.append(ratio)
    return out


RATIO_COLUMNS = (
    ("gateway / peer", "system", "{}"),
    ("conv", "conversations", "{}"),
    *((name, name, "{:.2f}") for name, _ in RATIOS),
)


def summary(ratio_rows: list[dict], label: str) -> str:
    """One sentence per concurrency for the configuration `label` (a ratio row's system)."""
    lines = [
        f"- {r['conversations']} conversations: TTFT p50 {r['TTFT p50']:.2f}x, "
        f"turns/s {r['turns/s']:.2f}x, CPU per turn {r['CPU/turn']:.2f}x, "
        f"events per core {r['events/s/core']:.2f}x"
        for r in ratio_rows
        if r["system"] == label
    ]
    return f"`{label}`:\n" + "\n".join(lines) if lines else ""


def _lines(ax, rows: list[dict], x: str, y: str, group: str = "system") -> None:
    for label in dict.fromkeys(r[group] for r in rows):
        points = sorted((r[x], r[y]) for r in rows if r[group] == label and not math.isnan(r[y]))
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=label)


def plot_matrix(rows: list[dict], path: str) -> None:
    """Six panels against concurrency, one line per system."""
    panels = (
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"),
        ("added_ttft_p50_ms", "proxy-added TTFT p50 (ms)"),
        ("turns_per_s", "turns / s"),
        ("cpu_ms_per_turn", "proxy CPU ms / turn"),
        ("events_per_core_s", "SSE events / s / core"),
    )
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        _lines(ax, rows, "conversations", key)
        _ticks(ax, sorted({r["conversations"] for r in rows}), "log")
        ax.set_xlabel("conversations in flight")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    _save(fig, path)


def _ticks(ax, values: list, scale: str) -> None:
    """An x axis marked at the measured points, 1000s written as k."""
    if scale == "log":
        ax.set_xscale(
            "symlog", linthresh=min(v for v in values if v > 0)
        ) if 0 in values else ax.set_xscale("log")
    ax.set_xticks(values, [f"{v // 1000}k" if v >= 1000 else str(v) for v in values])
    ax.minorticks_off()


def plot_growth(
    rows: list[dict],
    x: str,
    y: str,
    xlabel: str,
    ylabel: str,
    path: str,
    group: str | None = "system",
    scale: str = "log",
) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if group:
        _lines(ax, rows, x, y, group)
        ax.legend(fontsize=8)
    else:
        ax.plot([r[x] for r in rows], [r[y] for r in rows], marker="o")
    _ticks(ax, sorted({r[x] for r in rows}), scale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _save(fig, path)


def _save(fig, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


HISTORY_COLUMNS = (
    ("system", "system", "{}"),
    ("history KB", "history_kb", "{}"),
    ("turns", "turns", "{}"),
    ("err", "errors", "{}"),
    ("CPU ms/turn", "cpu_ms_per_turn", "{:.2f}"),
    ("range of the runs", "cpu_range", "{}"),
)


def history_ratios(history: list[dict]) -> list[dict]:
    """Each gateway row of the history runs over the seed's and vllm-router's at the same size
    (and driven by the same client)."""
    peers = {
        (r["system"], r["history_kb"]): r for r in history if not r["system"].startswith("gateway")
    }
    out = []
    for r in (r for r in history if r["system"].startswith("gateway")):
        for (peer, kb), base in peers.items():
            # Rows of one client with one another: OpenAI SDK clients' with theirs.
            if (
                kb == r["history_kb"]
                and base["cpu_ms_per_turn"]
                and base.get("client") == r.get("client")
            ):
                out.append(
                    {
                        "system": f"{r['system']} / {peer}",
                        "history_kb": kb,
                        "ratio": r["cpu_ms_per_turn"] / base["cpu_ms_per_turn"],
                    }
                )
    return out


HISTORY_RATIO_COLUMNS = (
    ("gateway / peer", "system", "{}"),
    ("history KB", "history_kb", "{}"),
    ("CPU per turn", "ratio", "{:.2f}x"),
)
CACHED_COLUMNS = (
    ("cached conversations", "entries", "{:,}"),
    ("turns", "turns", "{}"),
    ("err", "errors", "{}"),
    ("CPU ms/turn", "cpu_ms_per_turn", "{:.2f}"),
    ("worker RSS MB (filled)", "rss_mb_filled", "{:.0f}"),
    ("worker RSS MB (after turns)", "rss_mb_after", "{:.0f}"),
)


def write_doc(path: str, plot_dir: str, fields: dict) -> None:
    """Fill the Markdown template; `fields` holds every $name the template uses."""
    with open(TEMPLATE) as f:
        text = Template(f.read()).substitute(
            fields, plots=os.path.relpath(plot_dir, os.path.dirname(path))
        )
    with open(path, "w") as f:
        f.write(text)
