"""``freeze_heap`` in a process of its own (it would freeze the test runner's heap): what was alive is out of the
collector's sight, and what is made after is still collected."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_frozen_heap_keeps_collecting_what_comes_after():
    script = textwrap.dedent("""
        import gc
        from worker.heap import freeze_heap

        class Node:
            def __init__(self):
                self.me = self  # a cycle: only the collector frees it

        alive = [Node() for _ in range(1000)]
        freeze_heap("test")
        assert gc.get_freeze_count() > len(alive)
        assert len(gc.get_objects()) < 100  # a full collection walks only what came since
        garbage = [Node() for _ in range(500)]
        del garbage
        assert gc.collect() >= 500  # cycles made after the freeze are still found and freed
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
