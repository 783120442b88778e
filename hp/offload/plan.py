"""The offload plan: which saved activations leave the device, and when each comes back.

From a `hp.offload.use_def.Recording` and a budget (the most bytes the step's own
storages may take at any moment: saved activations, and what offload cannot
move, such as temporaries, gradients and optimizer states, as recorded), the
planner decides per saved activation: keep, or offload to the slow tier; and
per candidate block (a decoder layer, say), whether to recompute it instead
(`choose_recompute`). Eviction follows Belady: at the forward's peak, the tensor whose next
use is furthest away goes first (in backward that is the one saved
earliest). An offloaded tensor is resident from its definition until it is
written out (counted as its definition event), and again from its prefetch
event until its last use. Each prefetch leads its first use by the transfer
time (bytes / the tier's measured bandwidth), placed with the recorded event
times; where that lead would break the budget or does not exist, the
prefetch starts later and the step waits: the plan says how long
(`stall_s`). A budget that no choice meets is reported by how much
(`over_budget_bytes`), never silently exceeded.

Recompute is chosen per block where it costs less time than the moves it
replaces: a block's forward time (recorded) against, for what the plan
offloads from inside it, the copies out and back (bytes / bandwidth each,
times the share of that copy time the step pays: all of it on the disk tier,
whose copies run on the cores the step computes on) plus any expected stall.
A recomputed block keeps only its input, and what it saves exists again
from its backward on; the step is then recorded anew and its offload planned
on what it really saves.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from hp.plot import require_pyplot
from hp.offload.use_def import Recording, SavedTensor


@dataclass(frozen=True)
class Decision:
    """What happens to one saved tensor: kept, or offloaded with its prefetch event."""

    tensor: SavedTensor
    action: str  # "keep" or "offload"
    tier: str | None = None
    prefetch_at: int | None = None  # the event after which it is read back


@dataclass(frozen=True)
class OffloadPlan:
    """Decisions for every saved tensor, and the step's memory per event before and after."""

    decisions: tuple[Decision, ...]
    budget_bytes: int
    before: tuple[int, ...]
    after: tuple[int, ...]
    stall_s: float
    bandwidth: float  # bytes per second of the slow tier, measured
    recompute: tuple[str, ...] = ()  # the blocks recomputed in backward instead

    @property
    def peak_before(self) -> int:
        return max(self.before, default=0)

    @property
    def peak_after(self) -> int:
        return max(self.after, default=0)

    @property
    def over_budget_bytes(self) -> int:
        return max(0, self.peak_after - self.budget_bytes)

    @property
    def offloaded_bytes(self) -> int:
        return sum(d.tensor.nbytes for d in self.decisions if d.action == "offload")

    def plot(self, path: str) -> None:
        """The memory timeline before and after, with the budget, as a PNG (needs the `plot` extra)."""
        plt = require_pyplot("OffloadPlan.plot")
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([b / 2**20 for b in self.before], label="without offload")
        ax.plot([b / 2**20 for b in self.after], label="hp.offload")
        ax.axhline(self.budget_bytes / 2**20, color="gray", linestyle="--", label="budget")
        ax.set_xlabel("event (a save in forward, a read in backward)")
        ax.set_ylabel("the step's memory (MiB)")
        ax.legend()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def table(self) -> str:
        """One row per saved tensor: bytes, definition, uses, decision, prefetch point."""
        rows = [("#", "bytes", "shape", "defined (event, module)", "uses", "decision", "prefetch after")]
        for d in self.decisions:
            t = d.tensor
            uses = f"{len(t.uses)}: {t.uses[0]}..{t.uses[-1]}" if t.uses else "0"
            rows.append((
                str(t.index), f"{t.nbytes:,}", "x".join(map(str, t.shape)) or "()", f"{t.defined_at} {t.defined_in}",
                uses, f"{d.action} -> {d.tier}" if d.action == "offload" else d.action,
                "" if d.prefetch_at is None else str(d.prefetch_at),
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(
            f"peak {self.peak_before:,} -> {self.peak_after:,} bytes (budget {self.budget_bytes:,}); "
            f"offloaded {self.offloaded_bytes:,} bytes; expected stall {self.stall_s * 1e3:.2f} ms"
        )
        if self.recompute:
            lines.append(f"recomputed in backward: {', '.join(self.recompute)}")
        if self.over_budget_bytes:
            lines.append(f"the budget cannot be met: {self.over_budget_bytes:,} bytes over")
        return "\n".join(lines)


def plan_offload(recording: Recording, budget_bytes: int, tier: str, bandwidth: float,
                 recompute: tuple[str, ...] = ()) -> OffloadPlan:
    """Offload decisions that keep the step's memory under `budget_bytes` at every event
    (`recompute`: the blocks the recorded step already recomputes, for the plan's record).

    >>> from hp.offload.use_def import Recording, SavedTensor
    >>> a = SavedTensor(0, 100, (25,), None, "activation", defined_at=0, defined_in="", uses=[3])
    >>> b = SavedTensor(1, 100, (25,), None, "activation", defined_at=1, defined_in="", uses=[2])
    >>> rec = Recording([a, b], event_times=[0.0, 1.0, 2.0, 3.0], backward_start=2)
    >>> p = plan_offload(rec, budget_bytes=100, tier="disk", bandwidth=1e9)
    >>> [d.action for d in p.decisions], p.peak_before, p.peak_after
    (['offload', 'keep'], 200, 100)
    """
    other = recording.other_bytes()
    limits = [budget_bytes - o for o in other]  # what saved activations may take at each event
    chosen, after = _offload_choices(recording, limits, bandwidth, {})
    stall = sum(_stall(recording, recording.tensors[i], p, bandwidth) for i, p in chosen.items())
    decisions = tuple(
        Decision(t, "offload", tier, chosen[t.index]) if t.index in chosen
        else Decision(t, "keep" if t.kind == "activation" else "input")
        for t in recording.tensors
    )
    before = tuple(a + o for a, o in zip(recording.resident_bytes(), other))
    return OffloadPlan(decisions, budget_bytes, before, tuple(a + o for a, o in zip(after, other)), stall, bandwidth,
                       recompute)


def choose_recompute(recording: Recording, plan: OffloadPlan, copy_share: float) -> tuple[str, ...]:
    """The blocks whose recompute costs less time than moving what `plan` offloads from them.

    >>> from hp.offload.use_def import Block, Recording, SavedTensor
    >>> a = SavedTensor(0, 10**9, (), None, "activation", defined_at=0, defined_in="layers.0.mlp", uses=[1])
    >>> rec = Recording([a], event_times=[0.0, 0.1], backward_start=1, blocks=[Block("layers.0", 0.05)])
    >>> plan = plan_offload(rec, budget_bytes=0, tier="disk", bandwidth=1e10)
    >>> choose_recompute(rec, plan, copy_share=1.0)  # 0.2 s of copies against 0.05 s of forward
    ('layers.0',)
    """
    moved = {d.tensor.index: d.prefetch_at for d in plan.decisions if d.action == "offload"}
    gains = []  # (time saved, block, what it saves inside)
    for block in recording.blocks:
        inside = [t for t in recording.activations() if block.holds(t) and t.index != block.input_index and t.uses]
        cost = sum(2 * t.nbytes / plan.bandwidth * copy_share + _stall(recording, t, moved[t.index], plan.bandwidth)
                   for t in inside if t.index in moved)
        if inside and cost > block.forward_s:
            gains.append((cost - block.forward_s, block, inside))
    # a recomputed block's saves exist again all at once from its backward: take a block only if the
    # budget still holds with the rest offloaded (or, over budget already, holds no worse)
    limits = [plan.budget_bytes - o for o in recording.other_bytes()]
    fixed: dict[int, int] = {}  # recomputed tensor -> the event it exists again
    taken: set[str] = set()
    for _, block, inside in sorted(gains, key=lambda g: -g[0]):
        again = min(t.uses[0] for t in inside)
        trial = {**fixed, **{t.index: again for t in inside}}
        _, after = _offload_choices(recording, limits, plan.bandwidth, trial)
        if _excess(after, limits) <= plan.over_budget_bytes:
            fixed = trial
            taken.add(block.name)
    return tuple(b.name for b in recording.blocks if b.name in taken)


def _offload_choices(recording: Recording, limits: list[int], bandwidth: float,
                     fixed: dict[int, int]) -> tuple[dict[int, int], list[int]]:
    """Belady's choice of tensors to offload (tensor -> prefetch event) under `limits`, and the
    activation bytes resident per event; `fixed` tensors are away until a given event (recomputed)."""
    chosen: dict[int, int] = {}
    candidates = sorted((t for t in recording.activations() if t.index not in fixed),
                        key=lambda t: -(t.uses[0] if t.uses else t.defined_at))
    after = recording.resident_bytes(fixed)
    for t in candidates:
        if _fits(after, limits):
            break
        if not t.uses:
            continue
        chosen[t.index] = _prefetch_event(recording, t, bandwidth)
        after = recording.resident_bytes({**fixed, **chosen})
        after = _delay_prefetches(recording, chosen, limits, after, fixed)
    return chosen, after


def _excess(after: list[int], limits: list[int]) -> int:
    """Bytes over the limits at the worst event (0 when they fit), as `OffloadPlan.over_budget_bytes` counts."""
    return max(0, max((a - b for a, b in zip(after, limits)), default=0))


def _fits(after: list[int], limits: list[int]) -> bool:
    return all(a <= b for a, b in zip(after, limits))


def _prefetch_event(recording: Recording, t: SavedTensor, bandwidth: float) -> int:
    """The latest event that still leaves the transfer time before `t`'s first use."""
    times = recording.event_times
    need = times[t.uses[0]] - t.nbytes / bandwidth
    latest = bisect.bisect_right(times, need) - 1  # last event at or before `need`
    return max(min(latest, t.uses[0] - 1), t.defined_at + 1)


def _delay_prefetches(recording: Recording, chosen: dict[int, int], limits: list[int], after: list[int],
                      fixed: dict[int, int]) -> list[int]:
    """Start prefetches later where their early start breaks the budget, at the latest when the
    tensor is needed (a read the step waits for)."""
    for index, start in sorted(chosen.items(), key=lambda kv: kv[1]):
        t = recording.tensors[index]
        while start < t.uses[0] and not _fits(after[start:t.uses[0] + 1], limits[start:t.uses[0] + 1]):
            start += 1
            chosen[index] = start
            after = recording.resident_bytes({**fixed, **chosen})
    return after


def _stall(recording: Recording, t: SavedTensor, start: int, bandwidth: float) -> float:
    times = recording.event_times
    return max(0.0, t.nbytes / bandwidth - (times[t.uses[0]] - times[start]))
