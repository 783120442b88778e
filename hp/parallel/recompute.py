"""Activation recompute: a block keeps only its inputs, and runs again in backward.

Why: the activations a training step keeps for backward grow with layers x
tokens and dominate memory at long sequences. Recomputing each decoder block
in backward keeps one hidden state per block instead of everything its
attention and MLP save, for about one more forward of compute (and of its
collectives) per step. `hp.Strategy(recompute=True)` turns it on for the plan's
blocks; this module is how, for any block:

- The block's `forward` is run under non-reentrant `torch.utils.checkpoint`,
  not its `__call__`: module hooks (FSDP2's unshard and reshard, hp's layout
  hooks, diagnostics such as `hp.comm.trace_each`) stay outside and run once
  per step, and FSDP2's pre-backward unshard has the parameters in place
  before the recompute reads them. (HF's own gradient checkpointing makes the
  same choice.)
- The forward is replaced on the instance; no wrapper module is added, so
  parameter names and `state_dict` keys stay the model's own (checkpoints and
  HF weights load unchanged).
- The recompute runs in backward, outside what the model's forward hooks
  entered: `hp.region()`, `hp.context_parallel` and `hp.rules`. It runs
  again under the forward's choices of each, so the same kernels run, issue
  the same collectives and save the same tensors.
- RNG state is restored before the recompute (checkpoint's default, and the
  simulated ranks' own states under `hp.simulated`), so dropout draws the
  same masks.
- Without gradients (evaluation, generation), or when a KV cache is passed
  (the recompute would write it twice), the block runs as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext

import torch
from torch import nn
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

from hp.layouts.rules import active_rules
from hp.ops.context_parallel import context_parallel, current_algorithm
from hp.ops.region import region

# Keyword arguments under which HF decoder layers take a KV cache.
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past", "cache")


def recompute(block: nn.Module) -> nn.Module:
    """`block`, changed in place to recompute its activations in backward instead of keeping them.

    >>> import torch
    >>> from hp.parallel.recompute import recompute
    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    >>> calls = []
    >>> _ = block[1].register_forward_pre_hook(lambda *args: calls.append(1))
    >>> recompute(block)(torch.ones(2, 4, requires_grad=True)).sum().backward()
    >>> len(calls)  # once in forward, once more in backward
    2
    >>> list(block.state_dict())  # the names are the block's own
    ['0.weight', '0.bias']
    """
    if not is_recomputed(block):
        block.forward = _Recomputed(block, block.__dict__.get("forward"))  # a compiled forward runs inside
    return block


def recompute_blocks(blocks: Iterable[nn.Module]) -> None:
    """`recompute` each of `blocks` (a model's decoder layers, say).

    >>> import torch
    >>> layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    >>> recompute_blocks(layers)
    >>> [is_recomputed(layer) for layer in layers]
    [True, True]
    """
    for block in blocks:
        recompute(block)


def is_recomputed(block: nn.Module) -> bool:
    """Whether `block` recomputes its activations in backward.

    >>> import torch
    >>> is_recomputed(recompute(torch.nn.Linear(2, 2))), is_recomputed(torch.nn.Linear(2, 2))
    (True, False)
    """
    return isinstance(block.__dict__.get("forward"), _Recomputed)


def keep_activations(block: nn.Module) -> nn.Module:
    """`block` keeping its activations again, as before `recompute` (its class's forward).

    >>> import torch
    >>> block = recompute(torch.nn.Linear(2, 2))
    >>> is_recomputed(keep_activations(block))
    False
    """
    if is_recomputed(block):
        del block.forward
    return block


class _Recomputed:
    """A block's forward run under checkpoint; set on the instance as its `forward`.

    The forward is the class's, or the one the instance had (a compiled one: checkpoint then
    stays eager around the graph, which runs again in backward; torch's checkpoint traced inside
    a graph refuses side effects that HF's layers have). It holds the block rather than its
    bound method, so a deep copy of a block with its class's forward recomputes the copy.
    """

    def __init__(self, block: nn.Module, inner: Callable | None = None) -> None:
        self.block, self.inner = block, inner

    def __call__(self, *args, **kwargs):
        forward = self.inner or functools.partial(type(self.block).forward, self.block)
        if not torch.is_grad_enabled() or any(kwargs.get(k) is not None for k in CACHE_ARGUMENTS):
            return forward(*args, **kwargs)
        return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=False, context_fn=_as_in_forward)


def _as_in_forward() -> tuple[AbstractContextManager, AbstractContextManager]:
    """checkpoint's context_fn, called in forward just before the block runs: (nothing for the forward,
    what the recompute must run under to repeat it)."""
    in_region, (algorithm, order), rules = _in_region(), current_algorithm(), active_rules()
    replay_rng = _simulated_rng_replay()

    def contexts() -> list[AbstractContextManager]:
        # A backward called inside a region (unusual) already has one: a second would see every op twice.
        return [region() if in_region and not _in_region() else nullcontext(), replay_rng(),
                context_parallel(algorithm, order=order), rules if rules is not None else nullcontext()]

    return nullcontext(), _Reentrant(contexts)


class _Reentrant(AbstractContextManager):
    """A context made anew each time it is entered (some torch releases enter checkpoint's
    recompute context more than once)."""

    def __init__(self, make: Callable[[], list[AbstractContextManager]]) -> None:
        self.make, self.stacks = make, []

    def __enter__(self) -> None:
        stack = ExitStack()
        for context in self.make():
            stack.enter_context(context)
        self.stacks.append(stack)

    def __exit__(self, *exc) -> bool | None:
        return self.stacks.pop().__exit__(*exc)


def _in_region() -> bool:
    return any(isinstance(mode, region) for mode in _get_current_function_mode_stack())


def _simulated_rng_replay() -> Callable[[], AbstractContextManager]:
    """A context that sets the simulated ranks' RNG states back to now, and restores them after.

    Under `hp.simulated` (LocalTensorMode) every simulated rank draws from its own saved state,
    apart from torch's generator, which is all that checkpoint restores: without this, dropout in
    the recompute would draw new masks there (real ranks need nothing of it).
    """
    mode = enabled_local_tensor_mode()
    if mode is None or not mode._per_rank_rng_states:
        return nullcontext
    states = mode._per_rank_rng_states
    forward = dict(states)  # the states are replaced as ranks draw, never changed in place

    @contextmanager
    def replay() -> Iterator[None]:
        after = dict(states)
        states.update(forward)
        try:
            yield
        finally:
            states.update(after)

    return replay
