"""Python's garbage collector once a process is up: its start-up objects (torch's, Ray's, the model's modules, the
tokenizer's tables: ~320,000 of them in an engine on CPU) moved out of the collector's sight.

A full collection walks every tracked object: 175-210 ms in that engine (CPU box), and on 2xH200 a TP=2 step's
launch waited 157-162 ms in the ranks' agreement on both ranks at once (`peer_tp2_profile_decode_h200x2_run7`): two
ranks doing the same work collect at the same step, while the device runs dry. After ``gc.freeze`` a full collection
takes microseconds, and what the steps allocate is still collected. vLLM freezes its workers' and engine core's heaps
the same way once they are warm."""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_heap(what: str) -> None:
    """Collect once, then put every object alive into the permanent generation, which no collection scans again;
    call it again once more was built (a worker's KV pool, a server's app): each call freezes what is new."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug("%s: %d objects frozen out of the garbage collector's sight in %.0f ms", what, gc.get_freeze_count(),
                 1e3 * (time.perf_counter() - start))
