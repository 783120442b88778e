"""The training examples and the held-out ones: a run's evaluation data, as `val_size` or `eval_dataset` say.

LlamaFactory evaluates on datasets of their own (`eval_dataset`, read like
`dataset`) or on a seeded random part of the training data (`val_size`: a
fraction, or a count); both are here, so that the loop and the checks
before launch read the same splits.

The launcher tokenizes them once to check them; `hand_over` leaves what it
made in a file that the workers it starts read instead of tokenizing the
data again (`SPLITS_ENV` names it; a file made for other data settings, or
examples with images, are not handed over).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from hp.train.data.examples import SFT_OPTIONS, Examples, build_examples, example_options, load_examples
from hp.train.data.tokenizer import Tokenizer


def load_splits(config: Any, tokenizer: Tokenizer) -> tuple[Examples, Examples | None]:
    """(training examples, evaluation examples or None) as the config's val_size / eval_dataset say.

    `eval_dataset` names datasets read like `dataset`; else a `val_size` > 0 holds out a seeded
    random part of the training examples (after packing, for pt), as LlamaFactory's split does.

    >>> from pathlib import Path
    >>> from types import SimpleNamespace
    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> config = SimpleNamespace(dataset="quickstart", dataset_dir=Path(__file__).parents[3] / "examples" / "data",
    ...                          stage="sft", template="default", cutoff_len=64, max_samples=100, val_size=0.1,
    ...                          eval_dataset=None, seed=0)
    >>> train, held = load_splits(config, ByteTokenizer())
    >>> len(train), len(held)
    (90, 10)
    """
    handed = _handed_over(config)
    if handed is not None:
        return handed
    examples = load_examples(config, tokenizer)
    if config.eval_dataset:
        held = build_examples(config.eval_dataset, config.dataset_dir, tokenizer, stage=config.stage,
                              template=config.template, cutoff_len=config.cutoff_len, max_samples=config.max_samples,
                              **example_options(config, tokenizer))
        return examples, held
    if config.val_size:
        return split_for_eval(examples, config.val_size, config.seed)
    return examples, None


def split_for_eval(examples: Examples, val_size: float, seed: int) -> tuple[Examples, Examples]:
    """(rest, held out): `val_size` (a fraction in (0, 1), or a count) of the examples drawn with `seed`.

    >>> data = Examples([{"input_ids": [i], "labels": [i]} for i in range(10)])
    >>> [len(part) for part in split_for_eval(data, 0.2, seed=0)]
    [8, 2]
    """
    n = len(examples)
    held = round(val_size * n) if val_size < 1 else int(val_size)
    if not 0 < held < n:
        raise ValueError(f"val_size = {val_size:g} holds out {held} of the {n} training examples: expected at least "
                         "one for evaluation and one left for training")
    order = list(range(n))
    random.Random(f"hp.train.data:eval:{seed}").shuffle(order)  # the text is part of the seed: keep it
    chosen = set(order[:held])
    rest = [e for i, e in enumerate(examples.examples) if i not in chosen]
    held_out = [e for i, e in enumerate(examples.examples) if i in chosen]
    return Examples(rest, examples.dropped, examples.vision), Examples(held_out, vision=examples.vision)


SPLITS_ENV = "HP_TRAIN_SPLITS"  # the file where the launcher left the splits it made
SPLITS_FILE = "splits.json"  # its name in the directory `hand_over` is given


def hand_over(splits: tuple[Examples, Examples | None], config: Any, directory: str) -> None:
    """Write `splits` (of text) into `directory` for the workers of this process, whose `load_splits` reads them."""
    if any(part is not None and part.vision is not None for part in splits):
        return
    path = Path(directory) / SPLITS_FILE
    train, held = splits
    path.write_text(json.dumps({"key": _key(config), "train": [train.examples, train.dropped],
                                "held": None if held is None else [held.examples, held.dropped]}))
    os.environ[SPLITS_ENV] = str(path)


def _handed_over(config: Any) -> tuple[Examples, Examples | None] | None:
    path = os.environ.get(SPLITS_ENV)
    if not path or not Path(path).is_file():
        return None
    saved = json.loads(Path(path).read_text())
    if saved["key"] != _key(config):
        return None
    held = saved["held"]
    return Examples(*saved["train"]), None if held is None else Examples(*held)


def _key(config: Any) -> str:
    """What the splits depend on: the model (its tokenizer), the data and how they are cut."""
    names = ("model_name_or_path", "dataset", "dataset_dir", "eval_dataset", "stage", "template", "cutoff_len",
             "max_samples", "val_size", "seed", *SFT_OPTIONS)
    return json.dumps({name: str(getattr(config, name, None)) for name in names})
