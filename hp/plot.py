"""matplotlib for hp's drawings, when the `plot` extra is installed.

hp draws to files only (`hp train`'s loss curve, an offload plan's memory,
an `hp.mpmd` timeline), on matplotlib's Agg backend, which needs no
display. The import and the backend are decided here, once.

>>> pyplot() is None or hasattr(pyplot(), "subplots")
True
"""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType | None:
    """`matplotlib.pyplot` on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415  (an optional extra)
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def require_pyplot(what: str) -> ModuleType:
    """`pyplot()`, or an ImportError saying that `what` needs the `plot` extra."""
    plt = pyplot()
    if plt is None:
        raise ImportError(f"{what} needs matplotlib: pip install 'hp[plot]'")
    return plt
