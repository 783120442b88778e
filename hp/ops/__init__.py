"""Per-op sharding rules (`hp.rule`) and the built-in rules hp registers on import.

Also the distributed kernels the rules select (attention, ring and Ulysses,
expert dispatch, fused and pipelined linears) and `hp.region`, where plain
tensors meet DTensors. May import `hp.layouts` and the base modules at the
top of hp (`watch`, `simulate`, `source`, `mesh`, `cost`); never a strategy,
a transform, the zoo or the trainer.
"""

from hp.ops import attention, factory, gather_scatter, grouped_mm, masked  # noqa: F401  (register their rules on import)
from hp.ops.rule import RuleError, parse_factors, rule

__all__ = ["RuleError", "parse_factors", "rule"]
