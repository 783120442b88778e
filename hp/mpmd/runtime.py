"""Run a plan of an MPMD step: each rank its own actions, the tensors between them point to point.

Each rank runs its list of actions in order (`hp.mpmd.plan.Plan`):

- **F** of a stage: its inputs are what the stages it receives from handed
  on for this micro-batch, taken from this rank or received (an envelope
  with the shape and dtype, the tensor inside it or after it); each
  becomes a leaf that records its gradient when both ends train. The
  stage's function computes its output (the last stage of a trained
  program: the micro-batch's loss), which is sent at once (non-blocking)
  to every rank that consumes it.
- **B** of a stage: the gradient of its output is the sum of what its
  trained consumers sent back (the last stage starts from its loss);
  autograd runs the stage's backward, and each input's gradient goes back to
  the stage it came from. Where the graph splits the stage's backward,
  B runs only as far as its inputs (`hp.mpmd.backward`) and **W**, later,
  the rest: its parameters' gradients.

Sends never block and each receive names its sender and a tag unique to
the flow, direction, micro-batch and step, so a plan whose replay
completes (`hp.mpmd.plan.replay`) cannot deadlock here: the tensors cross
on a gloo group through host memory on every device (`hp.mpmd.mailbox`
says why), and the receives of the next few actions are posted before
each action runs, so what they read crosses while the actions before them
run. Each runtime sends on a process group of its own: what one leaves in
flight when its steps end (a program running ahead has sent for a step
that never comes) cannot be received by another. Programs running ahead
work on a later batch: what a stage sends to a stage running less far
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

from hp.mpmd.backward import input_gradients
from hp.mpmd.clock import settle
from hp.mpmd.graph import Action, Node
from hp.mpmd.mailbox import CHANNEL_BACKEND, Mailbox
from hp.mpmd.plan import Plan, Slot

# What a stage runs: (the batch, the micro-batch index, its inputs in `Graph.inputs` order) -> its output.
StageFn = Callable[[Any, int, list[torch.Tensor]], torch.Tensor]
LOOKAHEAD = 3  # actions whose receives are posted before each action runs


class Runtime:
    """This rank's part of `plan`: `stages[node]` for each stage it runs, over process group `group`.

    `step(batch, *upcoming)` runs this rank's actions of one step (`upcoming`: the batches after this
    one, for the programs running ahead) and returns the losses this rank computed, by micro-batch.
    """

    def __init__(self, plan: Plan, stages: Mapping[Node, StageFn], *, group: Any = None,
                 device: torch.device | str = "cpu", channel: Any = None) -> None:
        self.plan, self.graph, self.stages = plan, plan.graph, dict(stages)
        # a gloo group of its own (`channel`, default: a new one of `group`'s ranks): what this runtime leaves
        # in flight no other can take, and tags are honoured (see `hp.mpmd.mailbox`)
        self.group = channel if channel is not None else subgroup(group, backend=CHANNEL_BACKEND)
        if dist.get_backend(self.group) != CHANNEL_BACKEND:
            raise ValueError(f"Runtime: channel is a {dist.get_backend(self.group)} group; the tensors between stages "
                             f"cross on {CHANNEL_BACKEND} (see hp.mpmd.mailbox)")
        self.device = torch.device(device)  # where received tensors land
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
        self._mailbox = Mailbox(self.group, self.device)
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
        actions = [a for a in self.plan.actions[self.rank] if 0 <= first + self.graph.ahead_of(a.node) < len(batches)]
        for later in actions[:LOOKAHEAD]:
            self._expect(later, step)
        for i, action in enumerate(actions):
            if i + LOOKAHEAD < len(actions):
                self._expect(actions[i + LOOKAHEAD], step)
            self._mailbox.progress()
            batch = batches[first + self.graph.ahead_of(action.node)]
            start, waited = time.perf_counter(), self._mailbox.waited
            if action.kind == "F":
                out = self._forward(action, batch, step)
                if not self.graph.outputs(action.node) and not self.graph.carried_outputs(action.node):
                    losses[action.micro] = out.detach()
            elif action.kind == "B":
                self._backward(action)
            else:
                self._held.pop((action.node, action.micro, "W"))()
            if self.measuring:
                settle(self.device)
            if step >= 0:  # the prologue is not timed
                end, waited = time.perf_counter(), self._mailbox.waited - waited
                self.samples.append((action, end - start - waited))
                self.slots.append(Slot(action, self.rank, start + waited - self._started, end - self._started))
        return losses

    # ---- forward and backward ----------------------------------------------------------------------------

    def _forward(self, action: Action, batch: Any, step: int) -> torch.Tensor:
        node, m = action.node, action.micro
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
        pieces, out = self._held.pop((node, m)), self._held.pop((node, m, "out"))
        consumers = [dst for dst in self.graph.outputs(node) if self.graph.trains(dst)]
        grad = sum(self._gradient(node, dst, m) for dst in consumers) if consumers else None
        if self.graph.splits(node):
            self._held[node, m, "W"] = input_gradients(out, grad, [x for joined in pieces for x in joined])
        else:
            torch.autograd.backward(out, grad)
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

    def _origin(self, src: Node, dst: Node, m: int, step: int, sent: int | None = None) -> tuple[int, int]:
        """(the rank, the tag) of micro-batch m's tensor from `src` to `dst`, received in step `step`; sent in
        step `sent` (default: this one) from the rank that step's plan ran it on."""
        plan = self._plan_of.get(step if sent is None else sent, self.plan)
        return plan.where[Action("F", *src, m)], self._tag(src, dst, m, 0, step)

    def _gradient_origin(self, src: Node, dst: Node, m: int) -> tuple[int, int]:
        """(the rank, the tag) of the gradient `dst` sends back to `src` for micro-batch m."""
        return self._where("B", dst, self.graph.consumer(src, dst, m)), self._tag(src, dst, m, 1, self.steps)

    def _expect(self, action: Action, step: int) -> None:
        """Post the receives `action` of step `step` will read from other ranks (`hp.mpmd.mailbox`)."""
        node, m = action.node, action.micro
        if action.kind == "F":
            sent = {src: None for src in self.graph.inputs(node)} | {
                src: step - (self.graph.ahead_of(src) - self.graph.ahead_of(node)) for src in self.graph.carried_inputs(node)}
            wanted = [((src, node, p, "fwd", step), self._origin(src, node, p, step, when))
                      for src, when in sent.items() for p in self.graph.pieces(src, node, m)]
        elif action.kind == "B":
            wanted = [(None, self._gradient_origin(node, dst, m)) for dst in self.graph.outputs(node) if self.graph.trains(dst)]
        else:
            wanted = []
        for key, (frm, tag) in wanted:
            if frm != self.rank and key not in self._held:
                self._mailbox.expect(frm, tag)

    def _input(self, src: Node, dst: Node, m: int, step: int, sent: int | None = None) -> torch.Tensor:
        """Micro-batch m's tensor from `src`, received in step `step` (see `_origin`). Received once, kept until
        its last reader here."""
        frm, tag = self._origin(src, dst, m, step, sent)
        key = (src, dst, m, "fwd", step)
        if frm != self.rank and key not in self._held:
            self._held[key] = [self._mailbox.take(frm, tag), self._uses(src, dst, m)]
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
        frm, tag = self._gradient_origin(src, dst, m)
        if frm == self.rank:
            return self._held.pop((src, dst, m, "bwd"))
        return self._mailbox.take(frm, tag)

    def _tag(self, src: Node, dst: Node, m: int, backward: int, step: int) -> int:
        """A tag unique to the flow, its direction, the micro-batch and the receiving step (modulo the steps
        whose sends can be in flight at once); even for the envelope, odd for the data."""
        pair = self._tags[src, dst]
        return 2 * (((pair * 2 + backward) * self._span + m) * max(self._window, 2) + step % max(self._window, 2))

    def _send(self, tensor: torch.Tensor, to: int, tag: int, received: int) -> None:
        """Send `tensor` to rank `to`, received in step `received` (the next one's for a program running ahead)."""
        self._sends += [(received, work) for work in self._mailbox.send(tensor, to, tag)]


def subgroup(group: Any, backend: str | None = None) -> Any:
    """A new process group of `group`'s ranks (None: the world's), of `backend` (None: the world's); every
    rank of the world makes it alike."""
    return own_group([members(group)], backend)


def members(group: Any) -> list[int]:
    """`group`'s global ranks (None: the world's)."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def own_group(blocks: list[list[int]], backend: str | None = None) -> Any:
    """Every rank makes each block's process group (of global ranks, of `backend`; None: the world's), in
    order (a new group is a collective of the world); this rank's, or None."""
    me, mine = dist.get_rank(), None
    for block in blocks:
        made = dist.new_group(block, backend=backend)
        mine = made if me in block else mine
    return mine


def step_loss(losses: dict[int, torch.Tensor], group: Any = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """The step's loss on every rank: the micro-batches' losses each rank's `Runtime.step` returned, summed
    over the micro-batches and the ranks (a collective: every rank calls it)."""
    total = torch.stack(list(losses.values())).sum().detach().float() if losses else torch.zeros((), device=device)
    dist.all_reduce(total, group=group)
    return total
