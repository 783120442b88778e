"""Per-op sharding rules (`hp.rule`) and the built-in rules hp registers on import."""

from hp.ops import attention, grouped_mm, masked  # noqa: F401  (register their rules on import)
from hp.ops.rule import RuleError, parse_factors, rule

__all__ = ["RuleError", "parse_factors", "rule"]
