"""`hp.offload(step)`: memory tiering planned from a step's use-definition chains.

Holds: `transform` (the wrapped step), `use_def` (what autograd saves, from
where to where), `plan` (which activations leave the device and when they
come back), `tiers` (where they wait), `states` (optimizer states between
updates) and `cache` (a decoding loop's KV cache).

May import: `hp.parallel` (recompute), `hp.layouts`, `hp.ops` and the base
modules at the top of `hp`. Never `hp.mpmd`, the zoo, `hp.train` or the CLI.
`hp.offload` is the transform itself once hp is imported; reach the modules
with `from hp.offload.plan import ...`.
"""

from hp.offload.transform import Offloaded, OffloadError, offload

__all__ = ["OffloadError", "Offloaded", "offload"]
