"""Per-op sharding rules (`hp.rule`) and the built-in rules hp registers on import."""

from hp.ops import attention  # noqa: F401  (registers the attention rules)
from hp.ops.rule import RuleError, parse_factors, rule

__all__ = ["RuleError", "parse_factors", "rule"]
