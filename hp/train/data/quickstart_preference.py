"""The preference quickstart's dataset: the uppercase task of `hp.train.data.quickstart`, judged in pairs.

Each record asks to uppercase six random letters; the chosen answer is
right, and the rejected one is a near miss that a model from random weights
finds as likely: the same letters uppercased in another order, or the
letters echoed unchanged. DPO (`examples/quickstart_dpo.yaml`) must then
raise the right answers above their near misses against a reference that
cannot tell them apart, which it does on the tiny Llama within a couple of
hundred steps on two CPU cores, so its preference accuracy and reward
margin are worth watching. Records are LlamaFactory's alpaca preference
layout (`ranking: true`, columns instruction, input, chosen, rejected); the
same files give a reward model's pairs (stage rm). KTO's feedback layout
(`quickstart_kto`: each answer alone with a `kto_tag`, the right ones
desirable) is written beside them. The files are seeded, so they are the
same on every run; `python examples/make_quickstart_data.py dpo` writes
the copies in `examples/data/`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from hp.train.data.quickstart import add_to_dataset_info
from hp.train.data.quickstart import records as uppercase_records

NAME = "quickstart_dpo"
KTO_NAME = "quickstart_kto"


def _near_miss(word: str, rng: random.Random) -> str:
    """A wrong answer close to right: the letters uppercased in another order, or echoed as they are."""
    if rng.random() < 0.5:
        return word
    letters = list(word.upper())
    while "".join(letters) == word.upper():
        rng.shuffle(letters)
    return "".join(letters)


def records(n: int, seed: int) -> list[dict[str, str]]:
    """`n` alpaca preference records, the same for the same seed.

    >>> records(1, 0)
    [{'instruction': 'uppercase', 'input': 'mynbiq', 'chosen': 'MYNBIQ', 'rejected': 'mynbiq'}]
    """
    rng = random.Random(f"preference:{seed}")
    return [{"instruction": r["instruction"], "input": r["input"], "chosen": r["output"],
             "rejected": _near_miss(r["input"], rng)} for r in uppercase_records(n, seed)]


def kto_records(n: int, seed: int) -> list[dict]:
    """The same pairs as `n` single answers with LlamaFactory's `kto_tag`: even records right, odd near misses.

    >>> [(r["output"], r["kto_tag"]) for r in kto_records(2, 0)]
    [('MYNBIQ', True), ('ZPPLMJ', False)]
    """
    return [{"instruction": r["instruction"], "input": r["input"], "output": r["chosen"] if i % 2 == 0 else r["rejected"],
             "kto_tag": i % 2 == 0} for i, r in enumerate(records(n, seed))]


def write(out_dir: Path, n: int = 2000, seed: int = 0) -> Path:
    """Write `quickstart_dpo.json` and `quickstart_kto.json` with their `dataset_info.json` entries (other entries
    kept); returns the former."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pairs, feedback = out_dir / f"{NAME}.json", out_dir / f"{KTO_NAME}.json"
    for path, rows in ((pairs, records(n, seed)), (feedback, kto_records(n, seed))):
        lines = ",\n".join(json.dumps(r) for r in rows)
        path.write_text(f"[\n{lines}\n]\n", encoding="utf-8")
    add_to_dataset_info(out_dir, NAME, {"file_name": pairs.name, "ranking": True, "columns": {
        "prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}})
    add_to_dataset_info(out_dir, KTO_NAME, {"file_name": feedback.name, "columns": {
        "prompt": "instruction", "query": "input", "response": "output", "kto_tag": "kto_tag"}})
    return pairs
