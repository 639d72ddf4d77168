"""Draw a dashboard's panels from a live Prometheus: a picture of what Grafana would show, and a check that every
panel has data.

It is not Grafana (none runs where these are built and tested): it reads the dashboard's exported JSON and draws
each panel where its ``gridPos`` puts it, with the panel's own queries (evaluated over a time range through
Prometheus's HTTP API), legend formats and unit. Dashboard variables take the values given, else All (``.*``).

    python dashboards/preview.py --prometheus http://127.0.0.1:9090 --minutes 15 --out docs/
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

HERE = Path(__file__).parent
GRID_COLUMNS = 24  # Grafana's grid: 24 columns, rows of 30 px
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLOURS = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#96d98d", "#fade2a", "#ffa6b0"]


@dataclass(frozen=True)
class Series:
    legend: str
    times: list[float]
    values: list[float]


def substitute(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with ``$name`` / ``${name}`` replaced by ``variables[name]``, All (``.*``) for the rest."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), ".*"), expr)


def legend(fmt: str | None, labels: dict[str, str]) -> str:
    """Grafana's legend format: ``{{label}}`` replaced by the series' label value."""
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__") + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def query_range(api: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    r = httpx.get(f"{api}/query_range", params={"query": expr, "start": start, "end": end, "step": step}, timeout=30)
    body = r.json()
    if body.get("status") != "success":
        raise ValueError(f"Prometheus refused {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def panels(dashboard: dict) -> list[dict]:
    """Every panel, row headers included, those inside collapsed rows after their row."""
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", []) if p["type"] == "row" else []
    return out


def charts(dashboard: dict) -> list[dict]:
    """The panels that show data: every panel but the row headers."""
    return [p for p in panels(dashboard) if p["type"] != "row"]


def formatter(unit: str | None):
    """A tick / value formatter for Grafana's unit names the dashboards use."""
    def scaled(value: float, steps: list[tuple[float, str]], digits: int = 1) -> str:
        for size, name in steps:
            if abs(value) >= size:
                return f"{value / size:.{digits}f} {name}"
        return f"{value:.{digits}f} {steps[-1][1]}" if steps[-1][0] == 1 else f"{value:.3g}"

    if unit == "bytes":
        return lambda v: scaled(v, [(1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B")], 0)
    if unit == "percentunit":
        return lambda v: f"{100 * v:.3g}%"
    if unit == "s":
        return lambda v: f"{v:.2f} s" if abs(v) >= 1 else f"{1e3 * v:.3g} ms" if abs(v) >= 1e-3 else f"{1e6 * v:.3g} µs"
    suffix = {"ops": " ops/s", "reqps": " req/s"}.get(unit or "", unit[len("suffix:"):] if unit and unit.startswith("suffix:") else "")
    return lambda v: f"{v:.3g}{suffix}"


def collect(dashboard: dict, api: str, start: float, end: float, variables: dict[str, str]) -> dict[int, list[Series]]:
    """Each panel's series (by panel id) over ``[start, end]``."""
    step = max(1.0, (end - start) / 240)
    out: dict[int, list[Series]] = {}
    for p in charts(dashboard):
        series = []
        for target in p.get("targets", []):
            for result in query_range(api, substitute(target["expr"], variables), start, end, step):
                points = [(float(t), float(v)) for t, v in result["values"] if v not in ("NaN", "+Inf", "-Inf")]
                if points:
                    series.append(Series(legend(target.get("legendFormat"), result["metric"]),
                                         [t - end for t, _ in points], [v for _, v in points]))
        out[p["id"]] = series
    return out


def draw(dashboard: dict, data: dict[int, list[Series]], path: Path, minutes: float) -> None:
    """One PNG of the dashboard laid out on Grafana's grid."""
    items = panels(dashboard)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in items)
    fig = plt.figure(figsize=(20, rows * 0.42), facecolor=BACKGROUND)
    grid = fig.add_gridspec(rows + 2, GRID_COLUMNS, left=0.045, right=0.99, top=0.985, bottom=0.01, hspace=0.9, wspace=0.9)
    title = fig.add_subplot(grid[0:2, :])
    title.axis("off")
    title.text(0, 0.5, f"{dashboard['title']}  ·  last {minutes:.0f} min  ·  drawn by dashboards/preview.py from Prometheus "
               "(not Grafana)", color=TEXT, fontsize=13, va="center")
    for p in items:
        g = p["gridPos"]
        y0 = g["y"] + 2
        if p["type"] == "row":
            ax = fig.add_subplot(grid[y0:y0 + 1, :])
            ax.axis("off")
            ax.text(0, 0.2, p["title"], color=TEXT, fontsize=12, fontweight="bold", va="center")
            continue
        ax = fig.add_subplot(grid[y0 + 1:y0 + g["h"], g["x"]:g["x"] + g["w"]])  # the first grid row: the title
        ax.set_facecolor(PANEL)
        for side in ax.spines.values():
            side.set_color(GRID)
        ax.set_title(p["title"], color=TEXT, fontsize=10, loc="left")
        fmt = formatter(p["fieldConfig"]["defaults"].get("unit"))
        series = data.get(p["id"], [])
        if not series:
            ax.text(0.5, 0.5, "No data", color=TEXT, ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([]), ax.set_yticks([])
            continue
        if p["type"] == "stat":
            ax.set_xticks([]), ax.set_yticks([])
            text = "\n".join(f"{fmt(s.values[-1])}" + (f"  {s.legend}" if len(series) > 1 else "") for s in series[:4])
            ax.text(0.5, 0.5, text, color=COLOURS[0], fontsize=22 if len(series) == 1 else 12, ha="center", va="center",
                    transform=ax.transAxes, fontweight="bold")
            continue
        for k, s in enumerate(series):
            ax.plot([t / 60 for t in s.times], s.values, color=COLOURS[k % len(COLOURS)], linewidth=1.4, label=s.legend)
        ax.set_xlim(-minutes, 0)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, fmt=fmt: fmt(v)))  # this panel's unit, not the last's
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f} min" if v else "now"))
        ax.tick_params(colors=TEXT, labelsize=8)
        ax.grid(color=GRID, linewidth=0.6)
        ax.legend(fontsize=7, loc="upper left", facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT, ncol=2 if len(series) > 4 else 1)
    fig.savefig(path, dpi=80, facecolor=BACKGROUND)
    plt.close(fig)


def render(dashboard: dict, api: str, path: Path, minutes: float, variables: dict[str, str]) -> dict[str, int]:
    """Draw ``dashboard`` over the last ``minutes`` into ``path``; the series count of every panel, by title."""
    end = time.time()
    data = collect(dashboard, api, end - 60 * minutes, end, variables)
    draw(dashboard, data, path, minutes)
    return {p["title"]: len(data[p["id"]]) for p in charts(dashboard)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", required=True, help="Prometheus's base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=15)
    parser.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE", help="a dashboard variable (default All)")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("dashboards", nargs="*", type=Path, default=sorted(HERE.glob("*.json")))
    args = parser.parse_args(argv)
    variables = {"__rate_interval": args.rate_interval, **dict(v.split("=", 1) for v in args.var)}
    api = f"{args.prometheus.rstrip('/')}/api/v1"
    empty = 0
    for source in args.dashboards:
        path = args.out / f"{source.stem}.png"
        counts = render(json.loads(source.read_text()), api, path, args.minutes, variables)
        missing = [title for title, n in counts.items() if not n]
        empty += len(missing)
        print(f"{path}: {len(counts)} panels, " + (f"no data in {missing}" if missing else "all with data"))
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
