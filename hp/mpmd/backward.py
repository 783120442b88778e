"""A stage's backward in two: its inputs' gradients now, its parameters' gradients later (zero-bubble's split).

In a pipeline the stage before waits only for the gradients of what it
sent; the parameters' gradients wait for nobody until the optimizer. So a
stage's backward can run as `B`, as far as its inputs, sending their
gradients back at once, and `W`, the rest, wherever the stage's rank would
otherwise idle (Qi et al., "Zero Bubble Pipeline Parallelism", 2023). Each
matrix product runs once either way: a linear layer's `B` computes the
gradient of its input, its `W` the gradient of its weight.

How, on autograd's graph: the **path** is every node from which one of the
inputs' gradient accumulators can be reached; `B` runs exactly those
(`torch.autograd.grad` to the inputs), and each path node that also leads
off the path (to parameters) has the gradient it received recorded on the
way. An off-path node never leads back onto the path (it would reach an
input), so every parameter's gradient is the sum, over the path nodes it
hangs off, of that node's recorded gradient pushed down its off-path edges.
`W` replays exactly that: one `torch.autograd.backward` per group of path
nodes sharing parameters, from their recorded gradients to those
parameters (accumulated into `.grad` as a plain backward would). Where a
group's nodes lie on one another's path (a parameter used twice), the
later one's recorded gradient replaces what reaches it again, so nothing
is counted twice.

>>> x = torch.ones(2, 3, requires_grad=True)
>>> layer = torch.nn.Linear(3, 1)
>>> later = input_gradients(layer(x).sum(), None, [x])
>>> x.grad.shape, layer.weight.grad is None
(torch.Size([2, 3]), True)
>>> later()
>>> layer.weight.grad
tensor([[2., 2., 2.]])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def input_gradients(output: torch.Tensor, grad: torch.Tensor | None,
                    inputs: Sequence[torch.Tensor]) -> Callable[[], None]:
    """Backward of `output` (seeded with `grad`; None for a scalar loss) as far as `inputs`: their gradients
    accumulated into `.grad`. Returns what runs the rest, once: the parameters' gradients into their `.grad`."""
    wanted = [x for x in inputs if x.requires_grad]
    if output.grad_fn is None:  # nothing of it trains
        return lambda: None
    if not wanted:  # nothing to send back: the whole backward is the parameters'
        return lambda: torch.autograd.backward(output, grad)
    path = _path(output.grad_fn, {get_gradient_edge(x).node for x in wanted})
    groups = _groups(path)
    recorded: dict[Node, tuple] = {}
    handles = [node.register_prehook(_recorder(recorded, node)) for group in groups for node in group[0]]
    try:
        grads = torch.autograd.grad(output, wanted, grad, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for x, g in zip(wanted, grads):
        if g is not None:
            x.grad = g if x.grad is None else x.grad + g
    return lambda: _weights(groups, recorded)


def _path(root: Node, targets: set[Node]) -> set[Node]:
    """The nodes reachable from `root` from which one of `targets` is reachable (`targets` included)."""
    seen, stack = {root}, [root]
    while stack:  # every node reachable from the root
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    leads: dict[Node, bool] = {}

    def reaches(node: Node) -> bool:  # iterative: a deep model's graph is deeper than Python's recursion
        pending = [node]
        while pending:
            top = pending[-1]
            children = [c for c, _ in top.next_functions if c is not None and c not in leads]
            if children:
                pending += children
                continue
            pending.pop()
            leads[top] = top in targets or any(leads[c] for c, _ in top.next_functions if c is not None)
        return leads[node]

    return {node for node in seen if reaches(node)}


def _groups(path: set[Node]) -> list[tuple[list[Node], list[torch.Tensor]]]:
    """The path nodes that lead off the path, grouped where their off-path parts share a parameter: each
    group's (nodes, the parameters they lead to)."""
    owners: dict[Node, Node] = {}  # a parameter's accumulator -> the first path node found leading to it
    parent: dict[Node, Node] = {}

    def find(node: Node) -> Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    leaves: dict[Node, list[Node]] = {}
    for node in path:
        found = _off_path_leaves(node, path)
        if not found:
            continue
        parent[node], leaves[node] = node, found
        for leaf in found:
            if leaf in owners:
                parent[find(node)] = find(owners[leaf])
            else:
                owners[leaf] = node
    grouped: dict[Node, tuple[list[Node], dict[Node, None]]] = {}
    for node, found in leaves.items():
        nodes, params = grouped.setdefault(find(node), ([], {}))
        nodes.append(node)
        params.update(dict.fromkeys(found))
    return [(nodes, [leaf.variable for leaf in params]) for nodes, params in grouped.values()]


def _off_path_leaves(node: Node, path: set[Node]) -> list[Node]:
    """The gradient accumulators (of parameters) reachable from `node` through nodes off `path`."""
    found, seen = [], set()
    stack = [child for child, _ in node.next_functions if child is not None and child not in path]
    while stack:
        child = stack.pop()
        if child in seen:
            continue
        seen.add(child)
        if hasattr(child, "variable"):  # an AccumulateGrad: a leaf that wants its gradient
            found.append(child)
        stack += [c for c, _ in child.next_functions if c is not None]
    return found


def _recorder(recorded: dict, node: Node):
    def record(grad_outputs: tuple) -> None:
        recorded[node] = grad_outputs
    return record


def _weights(groups: list[tuple[list[Node], list[torch.Tensor]]], recorded: dict[Node, tuple]) -> None:
    """Each group's recorded gradients pushed to its parameters; a node reached again gets its own back."""
    for nodes, params in groups:
        nodes = [n for n in nodes if n in recorded]
        edges = [(GradientEdge(n, i), g) for n in nodes for i, g in enumerate(recorded[n]) if g is not None]
        if not edges:
            continue
        handles = [n.register_prehook(lambda _, mine=recorded[n]: mine) for n in nodes] if len(nodes) > 1 else []
        try:
            torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=params, retain_graph=True)
        finally:
            for handle in handles:
                handle.remove()
    recorded.clear()
