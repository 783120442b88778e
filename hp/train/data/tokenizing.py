"""Records to token examples, one at a time or in a pool of processes: the tokenizing step of loading data.

Why this module exists: tokenizing is the slow part of loading a dataset,
and LlamaFactory's `preprocessing_num_workers` spreads it over processes.
So the work on one record is a picklable `Encoder` called on a `Job` (the
record, where it came from, and a kto record's KL answer), which
`encode_all` maps over the jobs in this process or in a pool, the records
keeping their order either way, so the examples are the same. An `Encoder`
gives a pt record's document (bos, its text, the document's end), an sft
record's ids and labels (each `<image>` its image's tokens, never
supervised), and an rm, dpo or kto record's example
(`hp.train.data.preference`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hp.train.config import PAIRWISE_STAGES, PREFERENCE_STAGES
from hp.train.config.templates import IMAGE_PLACEHOLDER, Template
from hp.train.data.dataset_info import INFO_FILE, DatasetSpec
from hp.train.data.encoding import Conversation, encode_conversation
from hp.train.data.preference import feedback_example, pairwise_example
from hp.train.data.records import (
    alpaca_conversation, feedback_record, pairwise_record, pt_text, record_images, sharegpt_conversation,
)
from hp.train.data.tokenizer import Tokenizer
from hp.train.data.vision import Vision

# A record to encode: its dataset, index and record, and the answer of its KL example (kto; else "").
Job = tuple[DatasetSpec, int, dict[str, Any], str]


@dataclass(frozen=True)
class Encoder:
    """One record (a `Job`) to its document (pt) or example (sft: ids, labels, images; rm, dpo, kto)."""

    tokenizer: Tokenizer
    template: Template
    stage: str
    cutoff_len: int
    end: int | None
    train_on_prompt: bool
    mask_history: bool
    vision: Vision | None = None  # set when the template places images

    def __call__(self, job: Job) -> Any:
        spec, i, record, kl_answer = job
        if self.stage == "pt":
            return _document(pt_text(record, spec, i), self.tokenizer, self.end)
        if self.stage in PREFERENCE_STAGES:
            return self._preference(spec, i, record, kl_answer)
        read = alpaca_conversation if spec.formatting == "alpaca" else sharegpt_conversation
        conv = read(record, spec, i)
        if conv.turns[-1][0] != "assistant":
            raise ValueError(f"{spec.where(i)}: the conversation ends with a user turn; sft needs a response last")
        if self.vision is not None:
            return self._with_images(conv, spec, i, record, self.vision)
        ids, labels = self._encode(conv)
        return {"input_ids": ids, "labels": labels}

    def _preference(self, spec: DatasetSpec, i: int, record: dict[str, Any], kl_answer: str) -> dict[str, Any]:
        """The rm/dpo pair or the kto example (with its KL side) of a record."""
        where = spec.where(i)
        if self.stage in PAIRWISE_STAGES:
            conv, chosen, rejected = pairwise_record(record, spec, i)
            return pairwise_example(conv, chosen, rejected, self.tokenizer, self.template, self.cutoff_len,
                                    where=where)
        conv, desirable = feedback_record(record, spec, i)
        return feedback_example(conv, kl_answer, desirable, self.tokenizer, self.template, self.cutoff_len,
                                where=where)

    def _encode(self, conv: Conversation, images: Sequence[list[int]] = (), *,
                whole: bool = False) -> tuple[list[int], list[int]]:
        """(ids, labels) of `conv`, cut to cutoff_len unless `whole`."""
        return encode_conversation(conv, self.tokenizer, self.template, None if whole else self.cutoff_len,
                                   train_on_prompt=self.train_on_prompt, mask_history=self.mask_history, images=images)

    def _with_images(self, conv: Conversation, spec: DatasetSpec, i: int, record: dict[str, Any],
                     vision: Vision) -> dict[str, list]:
        """The example of a record that may hold images: each `<image>` its image's tokens, none supervised."""
        where = spec.where(i)
        paths = record_images(record, spec, i)
        placeholders = sum(content.count(IMAGE_PLACEHOLDER) for _, content in conv.turns)
        if placeholders != len(paths):
            column = (f"its column {spec.columns['images']!r} names {len(paths)}" if spec.columns.get("images")
                      else f"the dataset has no images column in {INFO_FILE}, so it has {len(paths)}")
            raise ValueError(f"{where}: its messages hold {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) and "
                             f"{column} image(s); each image goes where an {IMAGE_PLACEHOLDER} stands, so the two "
                             "counts must be equal")
        runs = [vision.tokens(grid) for grid in vision.grids(paths, where)]
        ids, labels = self._encode(conv, runs)
        wanted = sum(len(run) - 2 for run in runs)
        found = ids.count(vision.image_token_id)
        if found > wanted:
            raise ValueError(f"{where}: its text spells the image token (id {vision.image_token_id}) itself, which "
                             "would take the place of an image's patches; expected it only where <image> is")
        if found < wanted:
            whole = len(self._encode(conv, runs, whole=True)[0])
            raise ValueError(
                f"{where}: cutoff_len = {self.cutoff_len} cuts through its images ({len(runs)} image(s) of {wanted} "
                f"image tokens in a conversation of {whole} tokens); hp train does not cut an image, whose tokens "
                f"must match its patches: expected cutoff_len >= {whole}, or smaller images"
            )
        example = {"input_ids": ids, "labels": vision.unsupervised(ids, labels)}
        return {**example, "images": paths} if paths else example


_WORKER_ENCODER: Encoder | None = None  # what a tokenizing process was started with


def _start_worker(encoder: Encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def _encode_in_worker(job: Job) -> Any:
    return _WORKER_ENCODER(job)


def encode_all(encoder: Encoder, jobs: list, workers: int) -> list:
    """`encoder` over `jobs` in order, in `workers` processes when more than one and worth it.

    Worth it is measured: the first `PROBE` records are encoded here, and the rest go to a pool only when
    they would take longer here than `POOL_START_S`, what starting the pool costs (its fork server imports
    hp, and with it torch). A dataset of a few thousand short records, which a byte tokenizer encodes in
    tens of milliseconds, is then not sent to sixteen processes that take seconds to start.

    The processes come from a fork server, not from a fork of this process: by now this
    process may run threads (a process group's, a tokenizer's) that hold locks a forked child
    would wait on forever or die over. And they run in a process pool executor, which raises
    when a worker dies (`BrokenProcessPool`), where `multiprocessing.Pool.map` waits forever.

    >>> encode_all(len, ["a", "bb", "ccc"], workers=16)  # three records: encoded here
    [1, 2, 3]
    """
    workers = min(workers, len(jobs) // 16)  # a process per handful of records costs more than it saves
    start = time.perf_counter()
    head = [encoder(job) for job in jobs[:PROBE if workers > 1 else len(jobs)]]
    rest = jobs[len(head):]
    if not rest or (time.perf_counter() - start) / len(head) * len(rest) < POOL_START_S:
        return head + [encoder(job) for job in rest]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per worker is the parallelism
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # imported once by the server, not by each worker
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(encoder,)) as pool:
        return head + list(pool.map(_encode_in_worker, rest, chunksize=max(1, len(rest) // (4 * workers))))


PROBE = 256  # records encoded here first, to time one
POOL_START_S = 5.0  # a fork server importing hp, then its workers: the seconds a pool must save to pay for itself


def _document(text: str, tokenizer: Tokenizer, end: int) -> list[int]:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(text) + [end]
