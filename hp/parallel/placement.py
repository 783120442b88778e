"""Where a model's sub-models run under `hp.mpmd`'s levels 2 and 3: the strategy's `mpmd_place` value.

One program runs beside a pipeline of `pp` stages, one per rank:

- `vision`: a vision-language model's tower (`hp.mpmd.programs.vision_language`),
  spread over the pipeline's own ranks (`pp`, its work placed in the
  pipeline's bubbles; the world is pp ranks) or on N ranks of its own (the
  last N of the world, pp + N ranks), each image's features sent to the first stage;
- `reference`: a preference stage's frozen reference model
  (`hp.mpmd.reference.policy_and_reference`), cut into the policy's `pp`
  stages and run a batch ahead: on the policy's ranks, in its bubbles
  (`pp`), or on `pp` ranks of its own (the world is 2 pp ranks), its
  log-probabilities sent to the policy's last stage.

Either may be `auto`: the `pp` ranks shared the faster way by the costs
measured on the model before it is cut (`hp.mpmd.choice`): the pipeline
over all of them with the placed program in its bubbles, or over fewer
with the program on the rest (a reference: half of them).

It is torch-free, like `hp.Strategy`, so that the launcher checks it before
any worker starts.

>>> Placement.of({"vision": "pp"}).own_ranks, Placement.of({"vision": 2}).own_ranks
(0, 2)
>>> Placement.of({"reference": 2}).ranks(pp=2)
(2, 3)
>>> Placement.of({"vision": 0})
Traceback (most recent call last):
...
hp.parallel.placement.PlacementError: vision = 0: expected 'pp' (the pipeline's ranks, in its bubbles), 'auto' (as measured costs say) or a number of ranks of its own >= 1
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hp.parallel.field_error import FieldError

PLACEABLE = ("vision", "reference")  # the sub-models hp train places
SHARED = "pp"  # a sub-model spread over the pipeline's own ranks
AUTO = "auto"  # the reference: the pp ranks shared as measured costs say (hp.mpmd.choice)


class PlacementError(FieldError):
    """A placement that cannot run; `key` names the sub-model ("": the whole placement)."""


@dataclass(frozen=True)
class Placement:
    """Which sub-model runs as a program of its own (`program`: one of PLACEABLE) and where: on the pipeline's
    ranks (`"pp"`) or on that many ranks of its own."""

    program: str
    where: int | str

    @classmethod
    def of(cls, spec: Placement | Mapping[str, Any]) -> Placement:
        if isinstance(spec, Placement):
            return spec
        if not isinstance(spec, Mapping) or not spec:
            raise PlacementError("", spec, ": expected a mapping of a sub-model to where it runs, e.g. "
                                 "{vision: pp}")
        for key, value in spec.items():
            if key not in PLACEABLE:
                raise PlacementError(str(key), value, f": no sub-model hp train places; expected one of "
                                     f"{', '.join(PLACEABLE)}")
        if len(spec) > 1:
            raise PlacementError("", dict(spec), ": hp train places one sub-model at a time so far; expected one of them")
        (program, where), = spec.items()
        if where not in (SHARED, AUTO) and (not isinstance(where, int) or isinstance(where, bool) or where < 1):
            raise PlacementError(program, where, f": expected {SHARED!r} (the pipeline's ranks, in its bubbles), "
                                 f"{AUTO!r} (as measured costs say) or a number of ranks of its own >= 1")
        return cls(program, where)

    @property
    def own_ranks(self) -> int:
        """Ranks the placed sub-model holds of its own, beyond the pipeline's."""
        return 0 if self.where in (SHARED, AUTO) else int(self.where)

    def ranks(self, pp: int) -> tuple[int, ...]:
        """The global ranks the placed sub-model runs on, beside a pipeline on ranks 0 .. pp - 1 (`auto`: known
        once its costs are measured, `hp.mpmd.choice.ReferenceChoice.ranks`).

        >>> Placement("vision", "pp").ranks(2), Placement("vision", 1).ranks(2)
        ((0, 1), (2,))
        """
        if self.where == AUTO:
            raise ValueError(f"mpmd.place.{self.program} = 'auto': its ranks are chosen from the costs measured "
                             "in the run (hp.mpmd.choice)")
        return tuple(range(pp)) if self.where == SHARED else tuple(range(pp, pp + self.own_ranks))

    def check_pipeline(self, pp: int, split: tuple[int, ...] | None) -> None:
        """That it fits a pipeline of `pp` stages cut by `split`; the key at fault named under `parallel`.

        >>> Placement("reference", 1).check_pipeline(2, None)
        Traceback (most recent call last):
        ...
        hp.parallel.placement.PlacementError: mpmd.place.reference = 1: the reference is cut into the policy's pp = 2 stages, one per rank; expected 'pp' (in the policy's bubbles), 'auto' or 2 ranks of its own
        """
        if self.where == AUTO and split is not None:
            raise PlacementError("pp_split", split, f" with mpmd.place.{self.program} = 'auto': the pipeline's "
                                 f"stages depend on the choice; leave it out, or place the {self.program} yourself")
        if self.program == "reference" and self.own_ranks not in (0, pp):
            raise PlacementError("mpmd.place.reference", self.where, f": the reference is cut into the policy's pp = "
                                 f"{pp} stages, one per rank; expected 'pp' (in the policy's bubbles), 'auto' or {pp} "
                                 "ranks of its own")

    def check_fits(self, config) -> None:
        """Refuse a model (an HF config) this placement cannot cut: a tower placed must be one whose only output
        is the image features the decoder's input takes (Qwen3-VL's deepstack also adds features inside the
        decoder's layers, which a placed tower does not send).

        >>> from transformers import LlamaConfig
        >>> Placement("vision", "pp").check_fits(LlamaConfig())
        Traceback (most recent call last):
        ...
        hp.parallel.placement.PlacementError: mpmd.place.vision = 'pp': llama has no vision tower to place
        """
        if self.program != "vision":
            return
        vision, kind = getattr(config, "vision_config", None), getattr(config, "model_type", "?")
        key = f"mpmd.place.{self.program}"
        if vision is None:
            raise PlacementError(key, self.where, f": {kind} has no vision tower to place")
        if getattr(vision, "deepstack_visual_indexes", None):
            raise PlacementError(key, self.where, f": {kind}'s vision tower also feeds its deepstack features to "
                                 "the decoder's layers, which a placed tower does not send; place a Qwen2.5-VL "
                                 "model's tower, or train this model with tp, dp or FSDP")

    def as_dict(self) -> dict[str, int | str]:
        """As written in a config: `{vision: pp}`."""
        return {self.program: self.where}


def check_zero_bubble(place: Placement | None, zero_bubble: object) -> None:
    """`mpmd.zero_bubble` (a placed step's pipeline splits its backward into input and weight gradients): true
    or false, and true only beside a placement.

    >>> check_zero_bubble(None, True)
    Traceback (most recent call last):
    ...
    hp.parallel.placement.PlacementError: mpmd.zero_bubble = True: only a placed step (mpmd.place) splits its pipeline's backward; leave it out
    """
    if not isinstance(zero_bubble, bool):
        raise PlacementError("mpmd.zero_bubble", zero_bubble, ": expected true or false")
    if zero_bubble and place is None:
        raise PlacementError("mpmd.zero_bubble", zero_bubble, ": only a placed step (mpmd.place) splits its "
                             "pipeline's backward; leave it out")
