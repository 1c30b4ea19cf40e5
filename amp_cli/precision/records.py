"""What the mixed-precision pass decided, as data: the report's "precision" section."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class KeptNode:
    node: str  # ONNX node name (or Relax var name)
    op: str
    reason: str  # policy | excluded-op | excluded-node | constant-range | fp32-input | unknown-op
    #             | opaque-call | control-flow
    count: int = 1  # ops of this node kept for this reason (an LSTM node has many)

    def to_dict(self):
        return dataclasses.asdict(self)


@dataclass
class ConstantIssue:
    node: str
    op: str
    max_abs: float
    limit: float
    action: str  # "kept-fp32" | "saturated-mask"
    count: int = 0

    def to_dict(self):
        return dataclasses.asdict(self)


@dataclass
class PrecisionReport:
    dtype: str
    accumulate: str
    ops_by_dtype: dict = field(default_factory=dict)  # "op:output dtype" -> count
    op_dtypes: list = field(default_factory=list)  # {op, inputs, output, count} per kind
    casts_inserted: int = 0
    kept_fp32: list = field(default_factory=list)  # KeptNode
    constants: list = field(default_factory=list)  # ConstantIssue
    underflow_flushed: int = 0  # scalar values flushed to zero
    converted_ops: int = 0
    total_ops: int = 0
    note: str = ""

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["kept_fp32"] = [k.to_dict() for k in self.kept_fp32]
        d["constants"] = [c.to_dict() for c in self.constants]
        return d
