"""What amp's TIR passes changed in a kernel, for the build report."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class LegalizeRecord:
    """One per kernel that the legalizer changed (or could not fully legalize)."""

    kernel: str
    rewrites: list[str] = field(default_factory=list)  # e.g. "store float16x3 -> 2+1"
    stage: str = "after VectorizeLoop"
    skipped: list[str] = field(default_factory=list)   # statements left alone, with the reason

    def to_dict(self) -> dict:
        return asdict(self)
