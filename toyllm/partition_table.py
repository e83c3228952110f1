"""A table of searched partitions per context length, and the tables shipped with toyllm (the paper's KVR-P).

A search (``toyllm.partition.search_partition``) costs hundreds of TTFT
evaluations; a table keeps what the searches found for a few context lengths,
as chunk ratios, and predicts a partition for any other length from the two
nearest (``PartitionTable.predict``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from .answers import shortcut
from .checks import check_int
from .partition import align_boundaries, partition_from_ratios, validate_partition


@shortcut("6.3",
          ships="stores partitions and calls partition_from_ratios, which runs the student's 6.3 in the edition")
class PartitionTable:
    """Best partitions per context length, for one number of processes (the paper's KVR-P).

    ``add(context, chunks)`` stores a searched partition; ``predict(context)``
    returns chunks for any length: the stored one on an exact match,
    otherwise the chunk ratios (chunk / context) interpolated linearly between
    the two nearest stored lengths, or the nearest entry's ratios outside
    the table's range (clamped, never extrapolated).
    """

    def __init__(self, world_size: int, about: str = ""):
        p = check_int(world_size, "world size must be an integer")
        if p < 1:
            raise ValueError(f"world size must be at least 1 process, got {p}")
        self.world_size = p
        self.about = about          # how the entries were found: command, date, machine (kept in the file)
        self._entries: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def contexts(self) -> list[int]:
        return sorted(self._entries)

    def add(self, context: int, chunks: Sequence[int]) -> None:
        """Store (or replace) the partition for ``context`` tokens."""
        C = check_int(context, "context must be an integer")
        self._entries[C] = validate_partition(chunks, context=C, world_size=self.world_size)

    def chunks(self, context: int) -> list[int]:
        """The stored partition for exactly ``context`` tokens."""
        if context not in self._entries:
            raise ValueError(f"no entry for context {context}; the table has {self.contexts}")
        return list(self._entries[context])

    def ratios(self, context: int) -> list[float]:
        """The stored partition for ``context`` as fractions of the context."""
        return [c / context for c in self.chunks(context)]

    def predict_ratios(self, context: int) -> list[float]:
        """Interpolated ratios for ``context`` tokens (they sum to 1)."""
        if not self._entries:
            raise ValueError("the partition table is empty: add() a searched partition first")
        C = check_int(context, "context must be an integer")
        if C < 1:
            raise ValueError(f"context must be at least 1 token, got {C}")
        keys = self.contexts
        per_rank = zip(*(self.ratios(k) for k in keys))        # each rank's ratio at every stored length
        # numpy's piecewise-linear interpolation: exact on a stored length, clamped outside the table's range
        # (the interpolation written out is Exercise 6.3, which the student edition holds no copy of)
        return [float(np.interp(C, keys, ratios)) for ratios in per_rank]

    def predict(self, context: int, multiple_of: int = 8) -> list[int]:
        """Chunk sizes for ``context`` tokens: exact on a stored length, else interpolated ratios rounded,
        then each boundary moved to the nearest multiple of ``multiple_of`` tokens (``align_boundaries``).

        Why 8: a rank attends over as many keys as its boundary's position,
        and the dense kernel's q k^T is slower per pair when that count is
        not a multiple of 8 (the benchmark's search section measures it); the
        searches step by multiples of 8 anyway. ``multiple_of=1`` keeps the
        rounded ratios as they are.
        """
        C = check_int(context, "context must be an integer")
        if C in self._entries:
            return self.chunks(C)
        return align_boundaries(partition_from_ratios(C, self.predict_ratios(C)), multiple_of)

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, **({"about": self.about} if self.about else {}),
                "entries": [{"context": C, "chunks": self.chunks(C), "ratios": self.ratios(C)}
                            for C in self.contexts]}

    @classmethod
    def from_dict(cls, d: dict) -> "PartitionTable":
        if not isinstance(d, dict) or "world_size" not in d or "entries" not in d:
            raise ValueError("a partition table dict needs 'world_size' and 'entries'")
        table = cls(d["world_size"], about=str(d.get("about", "")))
        for e in d["entries"]:
            table.add(e["context"], e["chunks"])
        return table

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "PartitionTable":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def __repr__(self) -> str:
        return f"PartitionTable(world_size={self.world_size}, contexts={self.contexts})"


# Tables searched with measured runs and shipped with the package, one file per model, kernel and number of
# processes; `python -m toyllm prefill --method kvr` uses the matching one when no partition is given.
SHIPPED_TABLES = Path(__file__).resolve().parent / "tables"


def shipped_table_path(model: str, attention: str, world_size: int) -> Path:
    """Where the shipped table for this model preset, attention kernel and number of processes would be."""
    return SHIPPED_TABLES / f"{model}-{attention}-p{world_size}.json"


def shipped_table(model: str, attention: str, world_size: int) -> PartitionTable | None:
    """The shipped table for this model, kernel and number of processes, or None if none was searched."""
    path = shipped_table_path(model, attention, world_size)
    return PartitionTable.load(path) if path.is_file() else None
