"""`hp.mpmd(step)`: a step whose collectives fly while other work computes, planned from measurements.

Holds: `transform` (the wrapped step and its chunk planner) and `timeline`
(each rank's collectives on its own clock, drawn and measured).

May import: `hp.parallel` (the strategy's chunk values), `hp.ops` (the
pipelined kernels and their in-flight collectives) and the base modules at
the top of `hp`. Never `hp.offload`, the zoo, `hp.train` or the CLI.
`hp.mpmd` is the transform itself once hp is imported; reach the modules with
`from hp.mpmd.timeline import ...`.
"""

from hp.mpmd.transform import Mpmd, MpmdError, mpmd

__all__ = ["Mpmd", "MpmdError", "mpmd"]
