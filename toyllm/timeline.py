"""Per-rank timeline events, shared by real parallel runs and the simulator.

An event is one interval of one rank's time: compute of a layer, waiting for
a receive, a send, an all-gather. Times are seconds from a common origin (the
moment all ranks passed a barrier in a real run, 0 in a simulation), so
events of different ranks line up on one axis.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

# Kinds of event, in the order a legend lists them.
EVENT_KINDS = ("compute", "recv_wait", "send", "send_wait", "allgather", "link_delay")


@dataclass
class Event:
    rank: int
    kind: str            # one of EVENT_KINDS
    start_s: float       # seconds from the common origin
    end_s: float
    layer: int | None = None
    label: str = ""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Event":
        return cls(**d)


class Timeline:
    """Records the events of one rank against ``origin`` (a ``time.perf_counter()`` value)."""

    def __init__(self, rank: int, origin: float | None = None):
        self.rank = rank
        self.origin = time.perf_counter() if origin is None else origin
        self.events: list[Event] = []

    def reset(self, origin: float | None = None) -> None:
        self.origin = time.perf_counter() if origin is None else origin
        self.events.clear()

    def now(self) -> float:
        """Seconds since the origin."""
        return time.perf_counter() - self.origin

    def add(self, kind: str, start_s: float, end_s: float, layer: int | None = None, label: str = "") -> None:
        self.events.append(Event(self.rank, kind, start_s, end_s, layer, label))

    @contextmanager
    def span(self, kind: str, layer: int | None = None, label: str = ""):
        """``with timeline.span("compute", layer=3): ...`` records the block's interval."""
        start = self.now()
        try:
            yield
        finally:
            self.add(kind, start, self.now(), layer, label)

    def to_dicts(self) -> list[dict]:
        return [e.to_dict() for e in self.events]
