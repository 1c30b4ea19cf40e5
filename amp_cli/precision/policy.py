"""THE op policy: which ops run in fp16/bf16, which follow their inputs, which stay in fp32.

The documented defaults are YAML files shipped inside the package (``policies/``: one per target
kind and precision); a user's ``--config`` replaces any of the three lists and ``--exclude-op`` /
``--exclude-node`` add exclusions. :func:`resolve_config` merges them (dataclass defaults < the
shipped policy < the user's config), :class:`OpPolicy` answers per op and node.
"""
from __future__ import annotations

import copy
from pathlib import Path

from .. import tvm_compat
from ..config import ConvertConfig, PolicyConfig, apply_section, read_yaml, validate
from ..errors import ConfigError

POLICY_DIR = Path(__file__).resolve().parent / "policies"
MODES = ("always", "follow", "never")
# TVM's registered TMixedPrecisionPolicy values (relax/op/op_common.h: kAlways, kFollow, kNever)
TVM_POLICY = {0: "always", 1: "follow", 2: "never"}


def default_policy_file(target_kind: str, precision: str) -> Path:
    """The shipped policy for a target kind ("cuda", "llvm") and precision ("fp16", "bf16")."""
    name = "cpu.yaml" if target_kind == "llvm" else f"cuda-{precision}.yaml"
    path = POLICY_DIR / name
    if not path.is_file():  # a broken install, never a silent "no policy"
        raise ConfigError(f"amp's default op policy {path} is missing (a broken installation? "
                          f"reinstall amp-cli)")
    return path


def resolve_config(cfg: ConvertConfig, target_kind: str) -> ConvertConfig:
    """A copy of ``cfg`` with the shipped policy for ``target_kind`` merged under the user's:
    each of always / follow / never the user set replaces the default list; exclusions are the
    user's."""
    resolved = copy.deepcopy(cfg)
    user = copy.deepcopy(cfg.precision.policy)
    if cfg.precision.precision != "fp32":  # fp32 converts nothing: no policy needed
        path = default_policy_file(target_kind, cfg.precision.precision)
        section = read_yaml(path).get("precision", {}).get("policy", {})
        apply_section(resolved.precision.policy, section, "precision.policy", str(path))
    for name in MODES:
        if getattr(user, name):
            setattr(resolved.precision.policy, name, getattr(user, name))
    resolved.precision.policy.exclude_ops = list(user.exclude_ops)
    resolved.precision.policy.exclude_nodes = list(user.exclude_nodes)
    validate(resolved)
    return resolved


def short_name(op_name: str) -> str:
    """``relax.nn.conv2d`` -> ``nn.conv2d`` (the names policies use)."""
    return op_name[len("relax."):] if op_name.startswith("relax.") else op_name


class OpPolicy:
    """Answers "always, follow or never?" for an op, and "is this node or op excluded?"."""

    def __init__(self, policy: PolicyConfig, node_types: dict[str, str] | None = None):
        self.lists = {mode: {short_name(o) for o in getattr(policy, mode)} for mode in MODES}
        self.exclude_ops = set(policy.exclude_ops)
        self.exclude_nodes = set(policy.exclude_nodes)
        self.node_types = node_types or {}

    def mode_of(self, op_name: str) -> tuple[str, str]:
        """(mode, why): the user's / default lists first (never wins), then TVM's registered
        policy; an op with neither (call_tir, call_dps_packed, ...) stays in fp32."""
        short = short_name(op_name)
        for mode in ("never", "always", "follow"):
            if short in self.lists[mode]:
                return mode, "policy"
        registered = tvm_compat.registered_mixed_precision_policy(op_name)
        if registered is None:
            return "never", "unknown-op"
        return TVM_POLICY.get(registered, "never"), "policy"

    def exclusion(self, node: str, op_name: str) -> str | None:
        """Why ``node`` (an ONNX node name) running ``op_name`` must stay in fp32, or None."""
        if node in self.exclude_nodes:
            return "excluded-node"
        if short_name(op_name) in self.exclude_ops or op_name in self.exclude_ops:
            return "excluded-op"
        if self.node_types.get(node) in self.exclude_ops:
            return "excluded-op"
        return None
