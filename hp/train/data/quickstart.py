"""The quickstart dataset: uppercase six lowercase letters, in LlamaFactory's alpaca format.

The quickstart must show learning within a couple of hundred optimizer
steps of the embedded tiny Llama (2 layers, hidden 128, byte vocabulary) on
two CPU cores, and the result must be checkable by eye. Uppercasing a fixed
number of letters is such a task: each answer byte sits a fixed distance
after its source byte, so one attention head with rotary positions can
learn the lookup, while the random letters (26^6 strings) keep it from
being memorized: held-out prompts come out right. With LlamaFactory's
`default` template an example is 43 tokens (41 bytes and two eos):

    Human: uppercase\\nqwerty<eos>\\nAssistant:QWERTY<eos>\\n

The loss (mean over the 8 supervised tokens: 6 letters, eos and newline)
starts at about ln(259) = 5.6, sits near 2.5 (the letters guessed at
random: 6/8 ln 26 = 2.4) while no head has found the lookup yet, then
drops within a few dozen steps: `examples/quickstart.yaml` (batch 32, lr
2e-3 with cosine decay) measured 1.5 at step 100, below 0.2 by step 140
and 0.05 at step 200. Earlier measurements, with a rendering that started
with bos and had no eos after the prompt (the plateau then sat near 3 for
50-100 steps): over 200 AdamW steps at batch 32 (lr 3e-3 with 10 warmup
steps and linear decay, lr 1e-3 and 2e-3 with cosine decay) below 0.2 by
step 100, 0.01-0.07 at the end, and greedy answers to 50 unseen prompts
all exact; batch 16 was noisier: lr 1e-3 (constant or cosine) ended at
0.01-0.5 with all answers exact, but lr 3e-3 with cosine decay stayed on
the plateau for all 200 steps. The files are seeded, so they are the same
on every run; `examples/make_quickstart_data.py` writes the copy in
`examples/data/` (`dataset_info.json` there names the vision-language
quickstart too: `hp.train.data.quickstart_vl`).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

NAME = "quickstart"
LETTERS = 6  # fixed: a constant offset between question and answer bytes is what makes it quick to learn


def records(n: int, seed: int) -> list[dict[str, str]]:
    """`n` alpaca records, the same for the same seed.

    >>> records(1, 0)
    [{'instruction': 'uppercase', 'input': 'mynbiq', 'output': 'MYNBIQ'}]
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(LETTERS))
        out.append({"instruction": "uppercase", "input": word, "output": word.upper()})
    return out


def write(out_dir: Path, n: int = 2000, seed: int = 0) -> Path:
    """Write `quickstart.json` (a record a line, for readable diffs) and its `dataset_info.json` entry (other
    entries kept); returns the former."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(json.dumps(r) for r in records(n, seed))
    data = out_dir / f"{NAME}.json"
    data.write_text(f"[\n{lines}\n]\n", encoding="utf-8")
    columns = {"prompt": "instruction", "query": "input", "response": "output"}  # the defaults, spelled out
    add_to_dataset_info(out_dir, NAME, {"file_name": data.name, "columns": columns})
    return data


def add_to_dataset_info(out_dir: Path, name: str, entry: dict) -> None:
    """Set `name`'s entry in `out_dir/dataset_info.json`, keeping the others, names in sorted order.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> add_to_dataset_info(d, "b", {"file_name": "b.json"}); add_to_dataset_info(d, "a", {"file_name": "a.json"})
    >>> list(json.loads((d / "dataset_info.json").read_text()))
    ['a', 'b']
    """
    path = out_dir / "dataset_info.json"
    info = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    info = dict(sorted({**info, name: entry}.items()))
    path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
