"""Run a plan of an MPMD step: each rank its own actions, the tensors between them point to point.

Each rank runs its list of actions in order (`hp.mpmd.plan.Plan`):

- **F** of a stage: its inputs are what the stages it receives from handed
  on for this micro-batch, taken from this rank or received (a header with
  the shape and dtype, then the tensor); each becomes a leaf that records
  its gradient when both ends train. The stage's function computes its
  output (the last stage of a trained program: the micro-batch's loss),
  which is sent at once (non-blocking) to every rank that consumes it.
- **B** of a stage: the gradient of its output is the sum of what its
  trained consumers sent back (the last stage starts from its loss);
  autograd runs the stage's backward, and each input's gradient goes back to
  the stage it came from.

Sends never block and each receive names its sender and a tag unique to
the flow, direction, micro-batch and step, so a plan whose replay
completes (`hp.mpmd.plan.replay`) cannot deadlock here. Each runtime sends
on a process group of its own: what one leaves in flight when its steps
end (a program running ahead has sent for a step that never comes) cannot
be received by another. Programs running
ahead work on a later batch: what a stage sends to a stage running less far
ahead is received that many steps later; before the first step, `step`
runs the steps before it for the stages far enough ahead to have a batch
(the prologue).

Every action is timed (its function or its backward, not the waits), and
every transfer's bytes counted: the first steps' samples make the cost
table (`samples`, `transfers`; `hp.mpmd.measure`). `slots` holds the last
step's actions as they ran, to draw.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from hp.mpmd.clock import settle
from hp.mpmd.graph import Action, Node
from hp.mpmd.plan import Plan, Slot

# What a stage runs: (the batch, the micro-batch index, its inputs in `Graph.inputs` order) -> its output.
StageFn = Callable[[Any, int, list[torch.Tensor]], torch.Tensor]
_HEADER = 8  # int64s: dtype code, ndim, then the shape
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)


class Runtime:
    """This rank's part of `plan`: `stages[node]` for each stage it runs, over process group `group`.

    `step(batch, *upcoming)` runs this rank's actions of one step (`upcoming`: the batches after this
    one, for the programs running ahead) and returns the losses this rank computed, by micro-batch.
    """

    def __init__(self, plan: Plan, stages: Mapping[Node, StageFn], *, group: Any = None,
                 device: torch.device | str = "cpu", channel: Any = None) -> None:
        self.plan, self.graph, self.stages = plan, plan.graph, dict(stages)
        # a group of its own (`channel`, default: a new one of `group`'s ranks): what this runtime leaves in
        # flight no other can take
        self.group = channel if channel is not None else subgroup(group)
        self.device = torch.device(device)  # where received tensors land (nccl and hccl send device tensors)
        self.measuring = True  # each action waits for the device before its end is read (hp.mpmd.clock)
        self.rank = dist.get_rank(group)
        self.samples: list[tuple[Action, float]] = []  # (action, seconds) measured here
        self.transfers: list[tuple[Node, Node, int]] = []  # (src, dst, bytes) sent from here
        self.steps = 0
        self.slots: list[Slot] = []  # the last step's actions on this rank's clock (from the step's start)
        self._started = 0.0
        self._tags = {pair: i for i, pair in enumerate(
            (s, d) for s in self.graph.nodes() for d in self.graph.outputs(s) + self.graph.carried_outputs(s))}
        self._span = max(self.graph.micros(node) for node in self.graph.nodes())  # micro-batch indices a tag spans
        self._window = self.graph.furthest_ahead + 1  # steps a tag tells apart: sends in flight span that many
        self._held: dict = {}  # (node, micro, "out") -> output; (node, micro) -> inputs; grads by (src, dst, micro)
        self._sends: list = []  # (the step that receives it, its work)
        self._waited = 0.0  # seconds of the current action spent receiving (not the action's cost)
        self._plan_of: dict[int, Plan] = {}  # the plan each recent step ran: a stage running ahead sent by it

    def replan(self, plan: Plan) -> None:
        """Run `plan` (of the same graph) from the next step on: a plan made from the first steps' costs.
        What a program running ahead sent for the next step stays where the old plan sent it, so the
        stages receiving it must stay on their ranks."""
        if plan.graph != self.graph:
            raise ValueError("replan: the new plan is of another graph")
        for node in self.graph.nodes():
            for src in self.graph.carried_inputs(node):
                for m in range(self.graph.micros(node)):
                    if self._where("F", node, m) != plan.where[Action("F", *node, m)]:
                        raise ValueError(f"replan: {node} receives from {src}, which ran ahead; it must stay on its rank")
        self.plan = plan

    def step(self, batch: Any, *upcoming: Any) -> dict[int, torch.Tensor]:
        """Run this rank's actions of one step; the losses it computed, by micro-batch. `upcoming`: the
        batches after this one, as many as the graph runs ahead (`Graph.furthest_ahead`); at the end of
        the data fewer (or None), and the stages running past it have nothing to run."""
        batches = [batch, *itertools.takewhile(lambda b: b is not None, upcoming)]
        if self.steps == 0:  # the prologue: what the first steps receive from the stages running ahead
            for virtual in range(-self.graph.furthest_ahead, 0):
                self._run(virtual, batches)
        self.slots, self._started = [], time.perf_counter()
        losses = self._run(self.steps, batches)
        for work in [w for received, w in self._sends if received <= self.steps]:
            work.wait()  # what is sent for a later step is waited for in that step
        self._sends = [(received, w) for received, w in self._sends if received > self.steps]
        self.steps += 1
        return losses

    def _run(self, step: int, batches: list) -> dict:
        """This rank's actions of `step` (negative: the prologue's steps before the first, where only the
        stages running far enough ahead have a batch); `batches[0]` is the first batch (prologue) or this
        step's."""
        losses: dict[int, torch.Tensor] = {}
        self._plan_of = {s: p for s, p in self._plan_of.items() if s > step - self._window} | {step: self.plan}
        first = min(step, 0)  # the index in `batches` of step `step`'s own batch
        for action in self.plan.actions[self.rank]:
            index = first + self.graph.ahead_of(action.node)
            if not 0 <= index < len(batches):
                continue
            start = time.perf_counter()
            if action.kind == "F":
                out = self._forward(action, batches[index], step)
                if not self.graph.outputs(action.node) and not self.graph.carried_outputs(action.node):
                    losses[action.micro] = out.detach()
            else:
                self._backward(action)
            if self.measuring:
                settle(self.device)
            if step >= 0:  # the prologue is not timed
                end = time.perf_counter()
                self.samples.append((action, end - start - self._waited))
                self.slots.append(Slot(action, self.rank, start + self._waited - self._started, end - self._started))
        return losses

    # ---- forward and backward ----------------------------------------------------------------------------

    def _forward(self, action: Action, batch: Any, step: int) -> torch.Tensor:
        node, m = action.node, action.micro
        self._waited = 0.0
        pieces = [[self._input(src, node, p, step) for p in self.graph.pieces(src, node, m)]
                  for src in self.graph.inputs(node)]
        inputs = [joined[0] if len(joined) == 1 else torch.cat(joined) for joined in pieces]
        for src in self.graph.carried_inputs(node):  # sent in an earlier step: frozen, no gradient back
            sent = step - (self.graph.ahead_of(src) - self.graph.ahead_of(node))
            carried = [self._input(src, node, p, step, sent).detach() for p in self.graph.pieces(src, node, m)]
            inputs.append(carried[0] if len(carried) == 1 else torch.cat(carried))
        trains = self.graph.trains(node)
        with torch.enable_grad() if trains else torch.no_grad():
            out = self.stages[node](batch, m, inputs)
        if trains:
            self._held[node, m] = pieces
            self._held[node, m, "out"] = out
        for dst in self.graph.outputs(node) + self.graph.carried_outputs(node):  # received in step `step` + the gap
            self._hand_on(out.detach(), node, dst, m, step + self.graph.ahead_of(node) - self.graph.ahead_of(dst))
        return out

    def _backward(self, action: Action) -> None:
        node, m = action.node, action.micro
        self._waited = 0.0
        pieces, out = self._held.pop((node, m)), self._held.pop((node, m, "out"))
        consumers = [dst for dst in self.graph.outputs(node) if self.graph.trains(dst)]
        if consumers:
            grad = sum(self._gradient(node, dst, m) for dst in consumers)
            torch.autograd.backward(out, grad)
        else:
            torch.autograd.backward(out)
        for src, joined in zip(self.graph.inputs(node), pieces):
            for p, x in zip(self.graph.pieces(src, node, m), joined):
                if x.requires_grad:
                    self._send_back(x.grad if x.grad is not None else torch.zeros_like(x), src, node, p)

    # ---- moving tensors ------------------------------------------------------------------------------------

    def _where(self, kind: str, node: Node, m: int) -> int:
        return self.plan.where[Action(kind, *node, m)]

    def _hand_on(self, out: torch.Tensor, src: Node, dst: Node, m: int, step: int) -> None:
        """Micro-batch m's output to each rank consuming it (a gathering flow's group may span several), once."""
        for to in sorted({self._where("F", dst, c) for c in self.graph.consumers(src, dst, m)}):
            if to == self.rank:
                self._held[src, dst, m, "fwd", step] = [out, self._uses(src, dst, m)]
            else:
                self._send(out, to, self._tag(src, dst, m, 0, step), step)
                self.transfers.append((src, dst, out.numel() * out.element_size()))

    def _uses(self, src: Node, dst: Node, m: int) -> int:
        """How many of this rank's actions read micro-batch m of `src` on the flow to `dst`."""
        return sum(self._where("F", dst, c) == self.rank for c in self.graph.consumers(src, dst, m))

    def _input(self, src: Node, dst: Node, m: int, step: int, sent: int | None = None) -> torch.Tensor:
        """Micro-batch m's tensor from `src`, received in step `step`; sent in step `sent` (default: this one)
        from the rank that step's plan ran it on. Received once, kept until its last reader here."""
        plan = self._plan_of.get(step if sent is None else sent, self.plan)
        frm = plan.where[Action("F", *src, m)]
        key = (src, dst, m, "fwd", step)
        if frm != self.rank and key not in self._held:
            self._held[key] = [self._recv(frm, self._tag(src, dst, m, 0, step)), self._uses(src, dst, m)]
        held = self._held[key]
        x, held[1] = held[0], held[1] - 1
        if not held[1]:
            del self._held[key]
        wants_grad = self.graph.trains(src) and self.graph.trains(dst) and x.is_floating_point()
        return x.detach().requires_grad_(wants_grad)

    def _send_back(self, grad: torch.Tensor, src: Node, dst: Node, m: int) -> None:
        to = self._where("B", src, m)
        if to == self.rank:
            self._held[src, dst, m, "bwd"] = grad
        else:
            self._send(grad, to, self._tag(src, dst, m, 1, self.steps), self.steps)
            self.transfers.append((dst, src, grad.numel() * grad.element_size()))

    def _gradient(self, src: Node, dst: Node, m: int) -> torch.Tensor:
        frm = self._where("B", dst, self.graph.consumer(src, dst, m))
        if frm == self.rank:
            return self._held.pop((src, dst, m, "bwd"))
        return self._recv(frm, self._tag(src, dst, m, 1, self.steps))

    def _tag(self, src: Node, dst: Node, m: int, backward: int, step: int) -> int:
        """A tag unique to the flow, its direction, the micro-batch and the receiving step (modulo the steps
        whose sends can be in flight at once); even for the header, odd for the data."""
        pair = self._tags[src, dst]
        return 2 * (((pair * 2 + backward) * self._span + m) * max(self._window, 2) + step % max(self._window, 2))

    def _send(self, tensor: torch.Tensor, to: int, tag: int, received: int) -> None:
        """Send `tensor` to rank `to`, received in step `received` (the next one's for a program running ahead)."""
        tensor = tensor.contiguous()
        header = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
                              + [0] * (_HEADER - 2 - tensor.dim()), dtype=torch.int64, device=self.device)
        peer = dist.get_global_rank(self.group, to) if self.group is not None else to
        self._sends += [(received, dist.isend(header, peer, group=self.group, tag=tag)),
                        (received, dist.isend(tensor, peer, group=self.group, tag=tag + 1)),
                        (received, _Keep(header, tensor))]

    def _recv(self, frm: int, tag: int) -> torch.Tensor:
        start = time.perf_counter()
        peer = dist.get_global_rank(self.group, frm) if self.group is not None else frm
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, peer, group=self.group, tag=tag)
        code, ndim, *shape = header.tolist()
        out = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=self.device)
        dist.recv(out, peer, group=self.group, tag=tag + 1)
        self._waited += time.perf_counter() - start
        return out


def subgroup(group: Any) -> Any:
    """A new process group of `group`'s ranks (None: the world's); every rank of the world makes it alike."""
    return own_group([members(group)])


def members(group: Any) -> list[int]:
    """`group`'s global ranks (None: the world's)."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def own_group(blocks: list[list[int]]) -> Any:
    """Every rank makes each block's process group (of global ranks), in order (a new group is a collective
    of the world); this rank's, or None."""
    me, mine = dist.get_rank(), None
    for block in blocks:
        made = dist.new_group(block)
        mine = made if me in block else mine
    return mine


def step_loss(losses: dict[int, torch.Tensor], group: Any = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """The step's loss on every rank: the micro-batches' losses each rank's `Runtime.step` returned, summed
    over the micro-batches and the ranks (a collective: every rank calls it)."""
    total = torch.stack(list(losses.values())).sum().detach().float() if losses else torch.zeros((), device=device)
    dist.all_reduce(total, group=group)
    return total


class _Keep:
    """Holds a sent tensor until the step's sends are waited for (`isend` does not keep it alive)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def wait(self) -> None:
        self.tensors = ()
