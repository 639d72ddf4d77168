"""Pacing admissions by what mapping their cached prefixes costs.

A request that finds its prefix cached starts by mapping those pages into its slot: two driver calls a physical
page, about 60-120 us on the H100, in the step that admits it and before that step can be launched. A burst of such
admissions (512 requests on 32 shared prompts: 30 a step, 3K cached tokens each) maps for longer than the step in
flight computes, and the device waits: 2.2-3.2 s of a 19 s run (``bench/results/peer_prefix_idle_h100.json``). Paced,
a step admits cached prefixes only up to the pages the step before it took device time to hide, and the rest wait a
step while the running ones compute -- the mapping overlaps the device instead of idling it.
"""

from __future__ import annotations

from worker.messages import WorkerReport


class PrefixMappingPacer:
    """The pages of cached prefixes the next step may map (``budget``), from the workers' reports: the device time
    of their last step over the host time a page of admission mapping took (a moving average). No budget (None)
    until both are known -- off CUDA there is no device time -- or when pacing is off."""

    SMOOTHING = 0.3  # weight of the newest sample in the seconds-a-page average

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.seconds_per_page: float | None = None
        self.step_device_seconds: float | None = None
        self._last: dict[tuple[int, int], WorkerReport] = {}

    def update(self, reports: tuple[WorkerReport, ...]) -> None:
        """Fold in a step's reports (cumulative counters: only the change since each worker's last counts). The
        slowest worker sets the pace: every worker maps every page."""
        page, device = [], []
        for r in reports:
            key = (r.pp_rank, r.tp_rank)
            last = self._last.get(key)
            self._last[key] = r
            if last is None:
                continue
            if (pages := r.prefix_map_pages - last.prefix_map_pages) > 0:
                page.append((r.prefix_map_seconds - last.prefix_map_seconds) / pages)
            if (seconds := r.device_seconds - last.device_seconds) > 0:
                device.append(seconds)
        if page:
            sample = max(page)
            self.seconds_per_page = sample if self.seconds_per_page is None else (
                self.SMOOTHING * sample + (1 - self.SMOOTHING) * self.seconds_per_page)
        if device:
            self.step_device_seconds = min(device)

    def reset(self) -> None:
        """A rebuilt worker group counts from zero."""
        self._last.clear()

    @property
    def budget(self) -> int | None:
        if not self.enabled or not self.seconds_per_page or self.step_device_seconds is None:
            return None
        return int(self.step_device_seconds / self.seconds_per_page)
