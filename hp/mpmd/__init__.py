"""`hp.mpmd`: a step's work run concurrently, planned from measurements.

Level 1 (`hp.mpmd(step)`) overlaps a rank's collectives with its own
computation; levels 2 and 3 run sub-models and whole models as programs on
ranks of their own, in orders planned from a measured cost table.

Holds: `transform` (the wrapped step and its chunk planner), `timeline`
(each rank's collectives on its own clock, drawn and measured), and for
levels 2 and 3 `graph` (programs, stages and flows), `costs` (the cost
table), `schedule` (the planner), `plan` (a plan and its replay),
`simulate` (replays and projections), `runtime` (running a plan on the
ranks), `backward` (a stage's backward split into input and weight
gradients), `clock` (timing work on an accelerator), `measure` (the cost table
of a running step), `programs` (a
model's sub-models as programs), `reference` (a policy and its frozen
reference as programs), `choice` (where the reference runs, from measured
costs), `grid` (a placed step's replicas and tensor parallel planes),
`layout` (a stage laid out over its planes: what crosses, its log-probs)
and `placed` (the step transform of levels 2 and 3).

May import: `hp.parallel` (the strategy's chunk values), `hp.ops` (the
pipelined kernels and their in-flight collectives) and the base modules at
the top of `hp`. Never `hp.offload`, the zoo, `hp.train` or the CLI.
`hp.mpmd` is the transform itself once hp is imported; levels 2 and 3's
names hang on it (`hp.mpmd.Graph`, `hp.mpmd.schedule`, `hp.mpmd.simulate`,
...), and the modules are reached with `from hp.mpmd.timeline import ...`.
"""

from hp.mpmd.choice import choose_reference
from hp.mpmd.costs import Costs
from hp.mpmd.graph import Flow, Graph, GraphError, Program
from hp.mpmd.placed import Placed, PlaceError
from hp.mpmd.programs import vision_language
from hp.mpmd.reference import dpo_loss, kto_loss, policy_and_reference
from hp.mpmd.runtime import Runtime
from hp.mpmd.schedule import schedule
from hp.mpmd.simulate import project, simulate
from hp.mpmd.transform import Mpmd, MpmdError, mpmd

for _name, _value in {"Costs": Costs, "Flow": Flow, "Graph": Graph, "GraphError": GraphError, "Program": Program,
                      "Placed": Placed, "PlaceError": PlaceError,
                      "Runtime": Runtime, "schedule": schedule, "simulate": simulate, "project": project,
                      "vision_language": vision_language, "policy_and_reference": policy_and_reference,
                      "dpo_loss": dpo_loss, "kto_loss": kto_loss, "choose_reference": choose_reference}.items():
    setattr(mpmd, _name, _value)  # hp.mpmd.simulate(...): the transform carries its levels' names

__all__ = ["Costs", "Flow", "Graph", "GraphError", "Mpmd", "MpmdError", "PlaceError", "Placed", "Program", "Runtime",
           "choose_reference", "dpo_loss", "kto_loss", "mpmd", "policy_and_reference", "project", "schedule", "simulate",
           "vision_language"]
