"""Where in the user's code an event happened: the innermost frame outside torch and hp.

Collectives and op records carry this line so that a user sees which line of
their model (or of transformers' modelling code) caused a communication.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig

import torch

_LIBRARIES = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (torch, sys.modules[__name__.split(".")[0]])
)
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_SITE = tuple(os.path.abspath(p) + os.sep for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


@functools.cache  # a code object's file, asked of every frame of every op a diagnostic watches
def _is_internal(filename: str) -> bool:
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    if path.startswith(_LIBRARIES):
        return True
    return path.startswith(_STDLIB) and not path.startswith(_SITE)


def user_line() -> str:
    """`file.py:LINE in function` of the innermost frame that is neither torch, hp nor stdlib."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not _is_internal(path):
            return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1
