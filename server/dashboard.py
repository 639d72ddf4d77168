"""GET /dashboard: a live page of the KV memory, drawn on the server as SVG (no script, nothing fetched from
elsewhere). Per worker of every engine replica: the slot x page map -- each slot's virtual range, page by page,
mapped and holding tokens, shared with another slot, held by the prefix cache, mapped but empty (kept for reuse), or
reserved only -- and
the reserved / pool / mapped / used bytes over the last minutes."""

from __future__ import annotations

import html
import time
from collections import deque

from cluster.telemetry import EngineSnapshot
from kvmem.stats import PageMap

COLORS = {"U": "#2e7d32", "S": "#7b1fa2", "C": "#0097a7", "M": "#ef6c00", ".": "#e6e6e6"}
LABELS = {"U": "mapped, holds tokens", "S": "shared with another slot (copy-on-write)",
          "C": "held by the prefix cache (a later request that starts the same way maps it)",
          "M": "mapped, no token (kept for reuse)", ".": "reserved only (no memory)"}
SERIES = {"mapped": "#ef6c00", "used": "#2e7d32", "pool": "#1565c0"}
WIDTH = 900
#: The memory time series keeps this many samples (one per page load: the page reloads every 2 s).
HISTORY = 300
#: Content-Security-Policy of the page: it may load nothing at all, inline styles aside.
CSP = "default-src 'none'; style-src 'unsafe-inline'"


class MemoryHistory:
    """Each worker's memory as the page saw it, newest last."""

    def __init__(self, size: int = HISTORY):
        self.samples: deque[tuple[float, dict[tuple[str, int, int], tuple[int, int, int]]]] = deque(maxlen=size)

    def add(self, snapshots: dict[str, EngineSnapshot]) -> None:
        self.samples.append((time.time(), {(replica, w.pp_rank, w.tp_rank): (w.mapped_bytes, w.used_bytes, w.pool_bytes)
                                           for replica, s in snapshots.items() for w in s.workers}))


def _gib(n: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.{2 if shift == 30 else 1}f} {unit}"
    return f"{n:.0f} B"


def page_map_svg(m: PageMap) -> str:
    """One row per slot that ever held a page (the rest are all reserved: counted below), a rect per run of pages."""
    rows = [(k, row) for k, row in enumerate(m.slots) if row.strip(".")]
    per_slot = len(m.slots[0]) if m.slots else 0
    cell = max(WIDTH / max(per_slot, 1), 0.5)
    height = 6
    parts = []
    for y, (slot, row) in enumerate(rows):
        start = 0
        for i in range(1, len(row) + 1):
            if i == len(row) or row[i] != row[start]:
                parts.append(f'<rect class="p{row[start] if row[start] != "." else "R"}" x="{start * cell:.1f}" y="{y * (height + 1)}" '
                             f'width="{(i - start) * cell:.1f}" height="{height}" fill="{COLORS[row[start]]}"/>')
                start = i
        parts.append(f'<text x="{WIDTH + 4}" y="{y * (height + 1) + height}" font-size="7">slot {slot}'
                     f'{"" if m.in_use[slot] else " (free)"}</text>')
    h = max(len(rows) * (height + 1), height)
    return (f'<svg width="{WIDTH + 70}" height="{h}" xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>'
            f'<p class="note">{len(rows)} of {len(m.slots)} slots hold pages; {per_slot} pages of '
            f'{_gib(m.page_bytes)} per slot reserved; the other slots are reserved address space only.</p>')


def history_svg(history: MemoryHistory, key: tuple[str, int, int]) -> str:
    points = [(t, s[key]) for t, s in history.samples if key in s]
    if len(points) < 2:
        return '<p class="note">the memory series starts as the page refreshes</p>'
    t0, t1 = points[0][0], points[-1][0]
    top = max(max(v) for _, v in points) or 1
    w, h = WIDTH, 120

    def line(index: int) -> str:
        xy = " ".join(f"{(t - t0) / max(t1 - t0, 1e-9) * w:.1f},{h - v[index] / top * h:.1f}" for t, v in points)
        return f'<polyline fill="none" stroke="{list(SERIES.values())[index]}" stroke-width="1.5" points="{xy}"/>'

    legend = " ".join(f'<span style="color:{c}">&#9632; {n}</span>' for n, c in SERIES.items())
    return (f'<svg width="{w}" height="{h}" xmlns="http://www.w3.org/2000/svg">'
            f'<rect width="{w}" height="{h}" fill="#fafafa"/>{line(0)}{line(1)}{line(2)}</svg>'
            f'<p class="note">{legend} over the last {t1 - t0:.0f} s; top {_gib(top)}</p>')


def render(model_name: str, snapshots: dict[str, EngineSnapshot], maps: dict[str, dict[tuple[int, int], PageMap]],
           history: MemoryHistory) -> str:
    """The whole page: every replica, every worker."""
    legend = " ".join(f'<span><i style="background:{COLORS[k]}"></i>{html.escape(v)}</span>' for k, v in LABELS.items())
    body = []
    for replica in sorted(snapshots):
        s = snapshots[replica]
        body.append(f"<h2>replica {html.escape(replica)}: {s.num_running} running, {s.num_waiting} waiting, "
                    f"KV usage {s.kv_usage:.0%}</h2>")
        for w in s.workers:
            page_map = maps.get(replica, {}).get((w.pp_rank, w.tp_rank))
            body.append(
                f"<h3>worker pp{w.pp_rank} tp{w.tp_rank}</h3><p>reserved {_gib(w.reserved_bytes)} &middot; pool "
                f"{_gib(w.pool_bytes)} &middot; mapped {_gib(w.mapped_bytes)} &middot; used {_gib(w.used_bytes)} &middot; "
                f"fragmentation {w.fragmentation:.0%} &middot; free pages {w.free_pages} of {w.total_pages} &middot; "
                f"slots in use {w.slots_in_use} &middot; mapping stall {w.stall_seconds:.3f} s</p>"
                + (page_map_svg(page_map) if page_map is not None else '<p class="note">page map unavailable</p>')
                + history_svg(history, (replica, w.pp_rank, w.tp_rank)))
    if not body:
        body.append("<p>no engine replica answered</p>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>vattn KV memory: {html.escape(model_name)}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 18px; }} h2 {{ font-size: 15px; margin-top: 20px; }} h3 {{ font-size: 13px; margin-bottom: 4px; }}
.legend span {{ margin-right: 14px; }} .legend i {{ display: inline-block; width: 10px; height: 10px; margin-right: 4px; }}
.note {{ color: #666; font-size: 11px; margin: 2px 0 8px; }}
</style></head>
<body><h1>vattn KV memory &middot; {html.escape(model_name)}</h1>
<p class="legend">{legend}</p>
{"".join(body)}
</body></html>"""
