"""A global batch: tokenized examples padded into tensors, and the images they hold, as the model takes them.

A batch is what one forward reads: `input_ids` and `labels` (right-padded,
labels -100 past each example), and for a vision-language model
`mm_token_type_ids` (1 on image tokens, 0 elsewhere: HF computes M-RoPE's
3-D positions from it and falls back to 1-D positions without it),
`pixel_values` (every image's patch rows, in the order the images appear
in the batch) and `image_grid_thw` (a row per image). `Batch.inputs()` gives
the model's keyword arguments; a batch of text has only the first two, so a
text model is called exactly as before images existed. Iterating a batch
gives its tensors in that order, so a text batch unpacks as the
`(input_ids, labels)` pair it used to be.

The preference stages' batches (`hp.train.objectives`) are batches of text:
a pairwise one (rm, dpo) holds each pair's chosen answer in its first half
of rows and its rejected answer at the same row of the second half, as
LlamaFactory's collator concatenates them; a KTO one holds its answers, the
batch of their mismatched pairs (`kl`) and whether each answer is
desirable (`desirable`), which the objective reads and the model does not.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from hp.train.data.encoding import IGNORE_INDEX
from hp.train.data.vision import Vision


@dataclass(frozen=True)
class Batch:
    """The tensors of one forward, named as the model's keyword arguments (None: absent).

    >>> batch = Batch(torch.tensor([[5, 6]]), torch.tensor([[5, -100]]))
    >>> list(batch.inputs()), len(list(batch))
    (['input_ids', 'labels'], 2)
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    mm_token_type_ids: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    kl: Batch | None = None  # KTO: the answers' mismatched pairs
    desirable: torch.Tensor | None = None  # KTO: whether each answer is desirable (bool)

    def inputs(self, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """The present model inputs by name (moved to `device` when given): `model(**batch.inputs(device))`."""
        present = {f.name: getattr(self, f.name) for f in fields(self)
                   if f.name not in _NOT_INPUTS and getattr(self, f.name) is not None}
        return present if device is None else {name: t.to(device) for name, t in present.items()}

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.inputs().values())

    def __getitem__(self, index: int) -> torch.Tensor:
        return tuple(self.inputs().values())[index]


_NOT_INPUTS = ("kl", "desirable")  # what the objective reads, not the model


def collate(
    examples: Sequence[Mapping[str, Any]], pad_id: int, pad_to_multiple_of: int = 1, vision: Vision | None = None
) -> Batch:
    """The batch of `examples`: ids and labels right-padded to the longest (labels with -100); with `vision`, its images.

    Right padding needs no attention mask: causal attention never lets a real
    token see the pads after it, and their labels carry no loss.
    `pad_to_multiple_of` rounds the length up (context parallel splits the
    sequence into equal chunks). An example's images are the paths in its
    `images` key (see `hp.train.data.vision`). Pairwise examples (`chosen_ids`, `chosen_labels`, `rejected_ids`,
    `rejected_labels`) and KTO's (`input_ids`, `labels`, `kl_input_ids`, `kl_labels`, `kto_tag`) give the
    preference batches of the module docstring. A batch for a vision-language model
    (`vision` given) has `mm_token_type_ids` even when none of its examples has
    an image, and pixels only when one has.

    >>> ids, labels = collate([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
    ...                        {"input_ids": [4], "labels": [-100]}], pad_id=0, pad_to_multiple_of=2)
    >>> ids.tolist(), labels.tolist()
    ([[1, 2, 3, 0], [4, 0, 0, 0]], [[1, 2, 3, -100], [-100, -100, -100, -100]])
    """
    if "chosen_ids" in examples[0]:  # pairs: chosen rows, then rejected rows
        rows = [{"input_ids": e[f"{side}_ids"], "labels": e[f"{side}_labels"]}
                for side in ("chosen", "rejected") for e in examples]
        return collate(rows, pad_id, pad_to_multiple_of)
    if "kto_tag" in examples[0]:
        kl = [{"input_ids": e["kl_input_ids"], "labels": e["kl_labels"]} for e in examples]
        answers = collate([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples], pad_id,
                          pad_to_multiple_of)
        return Batch(answers.input_ids, answers.labels, kl=collate(kl, pad_id, pad_to_multiple_of),
                     desirable=torch.tensor([bool(e["kto_tag"]) for e in examples]))
    longest = max(len(e["input_ids"]) for e in examples)
    length = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    for row, e in enumerate(examples):
        ids[row, : len(e["input_ids"])] = torch.tensor(e["input_ids"], dtype=torch.long)
        labels[row, : len(e["labels"])] = torch.tensor(e["labels"], dtype=torch.long)
    if vision is None:
        return Batch(ids, labels)
    types = (ids == vision.image_token_id).to(torch.int32)
    paths = [path for e in examples for path in e.get("images", ())]
    if not paths:
        return Batch(ids, labels, types)
    pixels, grids = vision.pixels(paths)
    return Batch(ids, labels, types, pixels, grids)
