"""Write templates.json: LlamaFactory's own sft encoding of the golden records, for every template hp train has.

The ids and labels come from LlamaFactory's code, unchanged: for each
template (and, with `template` unset, for each Jinja chat template of
`golden_tokenizer.CHAT_TEMPLATES`) a fresh golden tokenizer goes through
`get_template_and_fix_tokenizer`, then `SupervisedDatasetProcessor.preprocess_dataset`
encodes each record (`golden_tokenizer.RECORDS`) at each cutoff_len of
`golden_tokenizer.CASES`, with `DataArguments`' defaults otherwise
(enable_thinking true, no train_on_prompt, no mask_history, no tools).
Then come the cases of `golden_tokenizer.OPTION_CASES`, encoded the same
way with those data arguments set (`default_system`, `train_on_prompt`,
`mask_history`, `enable_thinking`, `preserve_thinking`); each keeps them
as `data_args`, and where LlamaFactory refuses them, its error instead of
ids. Its `get_template_and_fix_tokenizer` sets `default_system` and the
thinking switches on the registered template itself, so each case gets a
fresh copy of it. `tests/test_templates.py` checks that hp's encoding
gives the same.

Made with LlamaFactory at commit ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30
(version 0.9.6.dev0) and transformers 5.24.0. To regenerate, put a
checkout of LlamaFactory's GitHub repository (hiyouga/LLaMA-Factory) at
/tmp/LLaMA-Factory, then, from hp's repository root:

    git -C /tmp/LLaMA-Factory checkout ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30
    pip install --no-deps --target /tmp/lfdeps peft==0.18.1 datasets==4.0.0 pyarrow dill multiprocess \\
        xxhash pandas python-dateutil pytz tzdata omegaconf antlr4-python3-runtime==4.9.3
    PYTHONPATH=/tmp/LLaMA-Factory/src:/tmp/lfdeps:. python tests/goldens/make_template_goldens.py

(`pip download llamafactory --no-deps` and unpacking the wheel onto
PYTHONPATH works too, for a released version.) LlamaFactory stays out of
hp's environment: it is only put on PYTHONPATH for this script, with the
few pure-Python packages its import chain needs in a folder of their own.
The script sets DISABLE_VERSION_CHECK=1, since LlamaFactory pins an older
transformers than hp uses (its template code runs on the newer one: where
add_special_tokens lost an argument it falls back on its own), and puts an empty module in place of torchaudio
when that cannot load (a torchaudio built for another torch): LlamaFactory
imports it for audio inputs only, which no text record reaches.
"""

from __future__ import annotations

import copy
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

from golden_tokenizer import CASES, CHAT_TEMPLATES, OPTION_CASES, RECORDS, golden_tokenizer, messages

LLAMAFACTORY_COMMIT = "ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30"
OUT = Path(__file__).with_name("templates.json")


def _import_llamafactory():
    """LlamaFactory's template and supervised-processor code, with the import workarounds the docstring lists."""
    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
    try:
        import torchaudio  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to load means: not usable here
        stub = types.ModuleType("torchaudio")
        stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        sys.modules["torchaudio"] = stub
    import llamafactory
    from llamafactory.data.processor import SupervisedDatasetProcessor
    from llamafactory.data.template import TEMPLATES, get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments

    return (llamafactory.__version__, SupervisedDatasetProcessor, get_template_and_fix_tokenizer, DataArguments,
            TEMPLATES)


def encode(lf, template: str | None, chat_template: str | None, record: dict, cutoff_len: int,
           data_args: dict | None = None) -> dict:
    """LlamaFactory's input_ids and labels for one record (with `data_args` set), or its error when it refuses them."""
    _, processor_class, get_template_and_fix_tokenizer, data_arguments, _ = lf
    tokenizer = golden_tokenizer(chat_template)  # fresh: LlamaFactory may replace its eos
    try:
        args = data_arguments(template=template, cutoff_len=cutoff_len, **(data_args or {}))
        lf_template = get_template_and_fix_tokenizer(tokenizer, args)
    except ValueError as e:
        if not data_args:
            raise
        return {"error": str(e)}
    processor = processor_class(template=lf_template, tokenizer=tokenizer, processor=None, data_args=args)
    turns = [m for m in messages(record) if m["role"] != "system"]
    batch = {"_prompt": [turns[:-1]], "_response": [turns[-1:]], "_system": [record["system"]], "_tools": [""],
             "_images": [None], "_videos": [None], "_audios": [None]}
    out = processor.preprocess_dataset(batch)
    return {"input_ids": out["input_ids"][0], "labels": out["labels"][0]}


def main() -> None:
    import transformers

    from hp.train.config.templates import TEMPLATES

    lf = _import_llamafactory()
    registered = lf[-1]
    pristine = {name: copy.copy(registered[name]) for name in TEMPLATES}
    cases = []
    for template, chat_template in [(name, None) for name in TEMPLATES] + [(None, name) for name in CHAT_TEMPLATES]:
        for record, cutoff_len in CASES:
            encoded = encode(lf, template, chat_template, RECORDS[record], cutoff_len)
            cases.append({"template": template, "chat_template": chat_template, "record": record,
                          "cutoff_len": cutoff_len, **encoded})
    for data_args, templates, chat_templates, pairs in OPTION_CASES:
        for template, chat_template in [(name, None) for name in templates] + [(None, name) for name in chat_templates]:
            for record, cutoff_len in pairs:
                if template is not None:  # LlamaFactory sets the data arguments on the registered template
                    registered[template] = copy.copy(pristine[template])
                encoded = encode(lf, template, chat_template, RECORDS[record], cutoff_len, data_args)
                cases.append({"template": template, "chat_template": chat_template, "record": record,
                              "cutoff_len": cutoff_len, "data_args": data_args, **encoded})
    header = {"llamafactory": {"version": lf[0], "commit": LLAMAFACTORY_COMMIT},
              "transformers": transformers.__version__, "made_by": "tests/goldens/make_template_goldens.py"}
    lines = [json.dumps(case, ensure_ascii=False) for case in cases]  # one case a line: readable diffs
    OUT.write_text('{"about": ' + json.dumps(header) + ',\n "cases": [\n' + ",\n".join(lines) + "\n]}\n",
                   encoding="utf-8")
    print(f"{len(cases)} cases written to {OUT}")


if __name__ == "__main__":
    main()
