"""Mixed precision: the op policy (``policy.py`` and the shipped ``policies/*.yaml``), the
conversion pass (``convert.py``), per-node range/error analysis (``sensitivity.py``) and the
accuracy-guided search (``auto.py``)."""
from .convert import convert_precision
from .policy import OpPolicy, resolve_config
from .records import ConstantIssue, KeptNode, PrecisionReport

__all__ = ["ConstantIssue", "KeptNode", "OpPolicy", "PrecisionReport", "convert_precision",
           "resolve_config"]
