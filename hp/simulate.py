"""`hp.simulated(mesh)`: compute every rank's values in one process, with hp still watching.

It enters `LocalTensorMode` over the mesh's ranks. A dispatch mode entered
before it (a `hp.comm.trace()`, `hp.explain`, `hp.strict`) would sit below
`LocalTensorMode` and see nothing, so `simulated` pushes a twin of each
active hp mode above it; twins share their originals' records.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

from torch.distributed._local_tensor import LocalTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

_ACTIVE: list[Watching] = []


class Watching(TorchDispatchMode):
    """A dispatch mode of hp's that `simulated` can re-enter above LocalTensorMode."""

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def begin_kernel(self, name: str, inputs: list):
        """A kernel of hp's own starts (see `kernel_scope`); returns a handle for `end_kernel`."""
        return None

    def end_kernel(self, handle, outputs: list) -> None:
        """The kernel of `handle` ended with `outputs` ([NotImplemented]: it declined)."""

    def twin(self) -> Watching:
        """A new mode that records into this one's state."""
        other = object.__new__(type(self))
        TorchDispatchMode.__init__(other)
        other.__dict__.update(self.__dict__)
        return other


@contextmanager
def kernel_scope(name: str, inputs: list):
    """Tell the active hp modes that a kernel of hp's own runs inside; append its result."""
    opened = [(mode, mode.begin_kernel(name, inputs)) for mode in list(_ACTIVE)]
    outputs: list = []
    try:
        yield outputs
    finally:
        for mode, handle in opened:
            mode.end_kernel(handle, outputs)


@contextmanager
def simulated(mesh):
    """Run the block as all ranks of `mesh` at once (real values, one process).

    >>> import hp, torch
    >>> mesh = hp.mesh(tp=2, simulate=True)
    >>> with hp.comm.trace() as t, hp.simulated(mesh):
    ...     y = hp.constrain(hp.shard(torch.ones(4, 2), "b/tp h", mesh), "b h")
    >>> t.count("all_gather")
    1
    """
    with ExitStack() as stack:
        stack.enter_context(LocalTensorMode(mesh.size()))
        for mode in list(_ACTIVE):
            stack.enter_context(mode.twin())
        yield
