"""Errors of the distributed engine."""

from __future__ import annotations


class WorkerGroupError(RuntimeError):
    """The worker group failed (an actor died, or a worker raised): the step's effects are unknown and
    the group must be rebuilt before the next step."""


class PlacementError(RuntimeError):
    """The worker group's placement group could not be placed in time."""


class EngineDeadError(RuntimeError):
    """The engine could not rebuild its worker group; it serves nothing more."""


class EngineDrainingError(RuntimeError):
    """The engine is being stopped: it finishes the requests it holds and takes no new ones (send them elsewhere)."""
