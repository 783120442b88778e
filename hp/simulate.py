"""`hp.simulated(mesh)`: compute every rank's values in one process, with hp still watching.

It enters `LocalTensorMode` over the mesh's ranks. A diagnostic entered
before it (a `hp.comm.trace()`, `hp.explain`, `hp.strict`) watches through a
dispatch mode that would sit below `LocalTensorMode` and see nothing, so
`simulated` puts a hub of `hp.watch` above it: the diagnostics then see the
same events wherever they were entered.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import DeviceMesh

from hp.watch import hub_on_top


@contextmanager
def simulated(mesh: DeviceMesh) -> Iterator[None]:
    """Run the block as all ranks of `mesh` at once (real values, one process).

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.comm.trace() as t, hp.simulated(mesh):
    ...     y = hp.constrain(hp.shard(torch.ones(4, 2), "b/tp h", mesh), "b h")
    >>> t.count("all_gather")
    1
    """
    with LocalTensorMode(mesh.size()), hub_on_top():
        yield
