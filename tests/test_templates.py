"""Chat templates: hp's sft encoding gives LlamaFactory's ids and labels, template by template.

The proof is `goldens/templates.json`, written by `goldens/make_template_goldens.py`
with LlamaFactory's own code on the tokenizer of `goldens/golden_tokenizer.py`;
here hp encodes the same records and must give the same input_ids and labels,
also with the data arguments that change the encoding (`default_system`,
`train_on_prompt`, `mask_history`, `enable_thinking`, `preserve_thinking`),
and must refuse what LlamaFactory refuses.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from goldens.golden_tokenizer import CHAT_TEMPLATES, RECORDS, golden_tokenizer, messages
from hp.train.config import ConfigError, validate
from hp.train.config.templates import TEMPLATES, Template
from hp.train.data import SFT_OPTIONS, ByteTokenizer, HFTokenizer, build_examples, load_examples
from hp.train.data.encoding import (
    IGNORE_INDEX, Conversation, check_template, configure, encode_conversation, encode_prompt, get_template,
    template_for,
)

ROOT = Path(__file__).parent.parent
GOLDENS = json.loads((Path(__file__).parent / "goldens" / "templates.json").read_text(encoding="utf-8"))
CASES = [case for case in GOLDENS["cases"] if "data_args" not in case]  # LlamaFactory's defaults
OPTION_CASES = [case for case in GOLDENS["cases"] if "data_args" in case]  # its data arguments set
TEMPLATE_OPTIONS = ("default_system", "enable_thinking", "preserve_thinking")  # the rest: encode_conversation's


@cache
def tokenizer(chat_template: str | None = None) -> HFTokenizer:
    return HFTokenizer(golden_tokenizer(chat_template))


def conversation(record: str) -> Conversation:
    r = RECORDS[record]
    return Conversation([(role, text) for role, text in r["turns"]], r["system"])


def case_id(case: dict) -> str:
    args = "".join(f"-{key}={value!r}" for key, value in case.get("data_args", {}).items())
    return f"{case['template'] or 'chat_template:' + case['chat_template']}-{case['record']}-{case['cutoff_len']}{args}"


def encode_with(case: dict) -> tuple[list[int], list[int]]:
    """hp's encoding of a golden case, with its data arguments set."""
    tok = tokenizer(case["chat_template"])
    args = case.get("data_args", {})
    template = template_for(case["template"], tok, **{k: v for k, v in args.items() if k in TEMPLATE_OPTIONS})
    return encode_conversation(conversation(case["record"]), tok, template, case["cutoff_len"],
                               **{k: v for k, v in args.items() if k not in TEMPLATE_OPTIONS})


# ---------------------------------------------------------------- the goldens


@pytest.mark.parametrize("case", CASES, ids=map(case_id, CASES))
def test_hp_encodes_like_llamafactory(case):
    tok = tokenizer(case["chat_template"])
    template = get_template(case["template"], tok)
    check_template(template, tok)
    ids, labels = encode_conversation(conversation(case["record"]), tok, template, case["cutoff_len"])
    assert ids == case["input_ids"]
    assert labels == case["labels"]


def test_the_goldens_cover_every_template_and_are_llamafactorys():
    assert {c["template"] for c in CASES} - {None} == set(TEMPLATES)
    assert {c["chat_template"] for c in CASES} - {None} == set(CHAT_TEMPLATES)
    assert GOLDENS["about"]["llamafactory"]["commit"] == "ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30"
    # the goldens test something: cut cases are cut, and answers are supervised but where the cut leaves them
    # no room (intern2's long default system prompt takes all of 12 tokens)
    encoded = [c for c in GOLDENS["cases"] if "error" not in c]
    assert all(len(c["input_ids"]) <= c["cutoff_len"] for c in encoded)
    starved = [c for c in encoded if all(label == IGNORE_INDEX for label in c["labels"])]
    assert [(c["template"], c["record"], c["cutoff_len"]) for c in starved] == [("intern2", "multi", 12)]
    # every data argument hp takes for the sft encoding is tried, and each set changes some case but one
    assert {key for c in OPTION_CASES for key in c["data_args"]} == set(SFT_OPTIONS)
    changed = {json.dumps(c["data_args"]) for c in OPTION_CASES
               if "error" not in c and encode_with({**c, "data_args": {}}) != (c["input_ids"], c["labels"])}
    tried = {json.dumps(c["data_args"]) for c in OPTION_CASES if "error" not in c}
    assert tried - changed == {'{"preserve_thinking": true}'}  # without mask_history there is nothing to preserve


# ---------------------------------------------------------------- the goldens with LlamaFactory's data arguments


@pytest.mark.parametrize("case", OPTION_CASES, ids=map(case_id, OPTION_CASES))
def test_hp_honours_the_data_arguments_as_llamafactory(case):
    if "error" in case:  # LlamaFactory refuses these: hp says so, quoting it
        with pytest.raises(ValueError, match="LlamaFactory refuses") as err:
            encode_with(case)
        assert case["error"].rstrip(".") in str(err.value)
        return
    ids, labels = encode_with(case)
    assert ids == case["input_ids"]
    assert labels == case["labels"]


def test_a_config_passes_the_data_arguments_to_the_encoding(tmp_path):
    """validate -> load_examples -> encoding gives the golden ids: the keys reach the encoding, whitespace kept."""
    info = {"r": {"file_name": "r.json", "formatting": "sharegpt", "columns": {"messages": "messages"},
                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                           "assistant_tag": "assistant", "system_tag": "system"}}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    checked = set()
    for case in OPTION_CASES:
        if "error" in case or case["template"] is None or case["template"] in checked:
            continue
        checked.add(case["template"])
        (tmp_path / "r.json").write_text(json.dumps([{"messages": messages(RECORDS[case["record"]])}]))
        config = validate({"model_name_or_path": "hp/tiny-llama", "dataset": "r", "dataset_dir": str(tmp_path),
                           "output_dir": str(tmp_path / "out"), "template": case["template"],
                           "cutoff_len": case["cutoff_len"], **case["data_args"]})
        assert {key: getattr(config, key) for key in case["data_args"]} == case["data_args"]
        (example,) = load_examples(config, tokenizer()).examples
        assert (example["input_ids"], example["labels"]) == (case["input_ids"], case["labels"]), case_id(case)
    assert len(checked) >= 10


def test_llamafactorys_defaults_change_nothing():
    config = validate({"model_name_or_path": "hp/tiny-llama", "dataset": "d", "output_dir": "o", **SFT_OPTIONS})
    assert {key: getattr(config, key) for key in SFT_OPTIONS} == SFT_OPTIONS
    assert configure(TEMPLATES["qwen3"], **{k: SFT_OPTIONS[k] for k in TEMPLATE_OPTIONS}) is TEMPLATES["qwen3"]


def test_text_only_templates_give_the_same_ids_on_the_byte_tokenizer():
    """The embedded model's tokenizer is the goldens' one without the added tokens: text-only templates agree."""
    byte = ByteTokenizer()
    added = [token for token, i in tokenizer().hf.get_added_vocab().items() if i >= byte.vocab_size]
    checked = 0
    for case in CASES:
        if case["template"] is None or TEMPLATES[case["template"]].required_tokens():
            continue
        tmpl = TEMPLATES[case["template"]]
        text = "".join([p for slot in (tmpl.prefix, tmpl.system, tmpl.user, tmpl.assistant) for p in slot
                        if isinstance(p, str)] + list(tmpl.thought or ()))
        if any(token in text for token in added):
            continue  # it spells a token that is whole only to the goldens' tokenizer (olmo's <|user|>: text to OLMo)
        if any(i >= byte.vocab_size for i in case["input_ids"]):
            continue  # the record spells an added token (<think>), which bytes cannot give
        ids, labels = encode_conversation(conversation(case["record"]), byte, get_template(case["template"], byte),
                                          case["cutoff_len"])
        assert (ids, labels) == (case["input_ids"], case["labels"]), case_id(case)
        checked += 1
    assert checked >= 50


# ---------------------------------------------------------------- template unset: the tokenizer's chat_template


@pytest.mark.parametrize("name", CHAT_TEMPLATES)
def test_unset_template_encodes_what_apply_chat_template_renders(name):
    tok = tokenizer(name)
    record = RECORDS["unicode"]
    rendered = tok.hf.apply_chat_template(messages(record), tokenize=False)
    ids, labels = encode_conversation(conversation("unicode"), tok, get_template(None, tok))
    assert ids == tok.hf.encode(rendered, add_special_tokens=False)
    # only the answers (with what ends them) are supervised
    answers = [text for role, text in record["turns"] if role == "assistant"]
    supervised = tok.hf.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX])
    end = "<|eot_id|>" if name == "llama3_bos" else "<|im_end|>\n"
    thought = "<think>\n\n</think>\n\n" if name == "chatml_thinking" else ""
    assert supervised == "".join(thought + a + end for a in answers)


def test_unset_template_reads_prefix_default_system_and_thinking():
    assert get_template(None, tokenizer("chatml")).default_system == ""
    assert get_template(None, tokenizer("chatml_default_system")).default_system == "You are a helpful assistant."
    assert get_template(None, tokenizer("chatml_thinking")).thought is not None
    assert get_template(None, tokenizer("chatml")).thought is None
    assert get_template(None, tokenizer("llama3_bos")).prefix == ("<s>",)


def test_unset_template_without_a_chat_template_is_empty():
    assert get_template(None, ByteTokenizer()) is TEMPLATES["empty"]
    assert get_template(None, tokenizer()) is TEMPLATES["empty"]  # an HF tokenizer without one


def test_generation_prompt_ends_where_the_answer_starts():
    tok = tokenizer()
    prompt = tok.hf.decode(encode_prompt("hi", tok, "qwen3"))
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # the thought is the answer's
    assert tok.hf.decode(encode_prompt("hi", tokenizer("chatml"))) == prompt  # unset: the chat_template's
    # enable_thinking false: the empty thought is given, as in training; default_system as in training
    assert tok.hf.decode(encode_prompt("hi", tok, "qwen3", enable_thinking=False)) == prompt + "<think>\n\n</think>\n\n"
    assert tok.hf.decode(encode_prompt("hi", tok, "qwen", default_system="Be brief.")) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n" + prompt)
    assert tok.hf.decode(encode_prompt("hi", tok, "qwen", "Mine.", default_system="Be brief.")).startswith(
        "<|im_start|>system\nMine.<|im_end|>")


# ---------------------------------------------------------------- pt


@pytest.mark.parametrize("template, end", [(None, "</s>"), ("qwen", "<|im_end|>"), ("llama3", "<|end_of_text|>")])
def test_pt_documents_end_as_in_llamafactory(tmp_path, template, end):
    (tmp_path / "t.json").write_text(json.dumps([{"text": "ab"}, {"text": "c"}]))
    tok = tokenizer()
    (block,) = build_examples("t.json", tmp_path, tok, stage="pt", template=template).examples
    end_id = tok.hf.convert_tokens_to_ids(end)
    assert block["input_ids"] == [tok.bos_token_id, 97, 98, end_id, tok.bos_token_id, 99, end_id]


# ---------------------------------------------------------------- bad inputs


def test_unknown_template_names_the_known_ones():
    with pytest.raises(ValueError, match=r"template 'qwen4' is unknown; known: default, empty, alpaca, chatml, qwen,"):
        get_template("qwen4")
    with pytest.raises(ConfigError, match=r"template = 'qwen4': expected one of 'default', 'empty', 'alpaca'"):
        validate({"model_name_or_path": "hp/tiny-llama", "dataset": "d", "output_dir": "o", "template": "qwen4"})


def test_a_missing_special_token_is_named_with_the_template():
    with pytest.raises(ValueError, match=r"template 'chatml' needs '<\|im_start\|>', '<\|im_end\|>' as special "
                                         r"tokens, which the tokenizer \(ByteTokenizer\(vocab_size=259\)\) lacks"):
        check_template(TEMPLATES["chatml"], ByteTokenizer())
    # a tokenizer holding only some of them: the message names the missing one alone
    only_start = Template("mine", special_tokens=("<|im_start|>", "<|nope|>"))
    with pytest.raises(ValueError, match=r"template 'mine' needs '<\|nope\|>' as a special token, which"):
        check_template(only_start, tokenizer())
    # a vocabulary that reads it as its unknown token does not have it either
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
    unknowing = HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", eos_token="</s>"))
    with pytest.raises(ValueError, match=r"template 'phi' needs '<\|user\|>', '<\|end\|>', '<\|assistant\|>', "
                                         r"'<\|system\|>' as special tokens"):
        check_template(TEMPLATES["phi"], unknowing)
    # pt needs only what ends a document
    check_template(TEMPLATES["gemma"], tokenizer(), stage="pt")
    with pytest.raises(ValueError, match=r"'<\|end_of_text\|>' as a special token"):
        check_template(TEMPLATES["llama3"], ByteTokenizer(), stage="pt")


def test_a_template_without_a_place_for_the_text_is_refused():
    with pytest.raises(ValueError, match=r"template 'mine': the assistant slot has no \{\{content\}\}"):
        Template("mine", assistant=("answer",))


def test_preflight_refuses_a_template_the_tokenizer_cannot_encode(tmp_path):
    """`preflight.check` runs this step after the model's and before the data's (the model step is slow to test)."""
    from hp.train.preflight import _check_template

    def config(template: str):
        return validate({"model_name_or_path": "hp/tiny-llama", "dataset": "quickstart", "template": template,
                         "dataset_dir": str(ROOT / "examples" / "data"), "output_dir": str(tmp_path / "out")})

    with pytest.raises(ConfigError, match=r"^template 'qwen3' needs '<\|im_start\|>', '<\|im_end\|>' as special "
                                          r"tokens.*LlamaFactory would add them.*\(default, empty, alpaca,"):
        _check_template(config("qwen3"), ByteTokenizer())
    _check_template(config("alpaca"), ByteTokenizer())  # spelled in text only: fine


def test_an_unreadable_chat_template_is_a_clear_error():
    hf = golden_tokenizer()
    hf.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    with pytest.raises(ValueError, match=r"template is unset and the tokenizer's chat_template cannot be read as a "
                                         r"template \(.*no system role\); set `template`"):
        get_template(None, HFTokenizer(hf))
    hf.chat_template = "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match=r"cannot be read as a template \(ValueError: .*the system slot has no"):
        get_template(None, HFTokenizer(hf))  # a template that drops system prompts


def test_refused_data_arguments_name_the_keys(tmp_path):
    """What LlamaFactory refuses is refused with both keys named: in the encoding, and before any worker starts."""
    from hp.train.preflight import _check_data

    (tmp_path / "a.json").write_text(json.dumps([{"instruction": "hi", "output": "yo"}]))

    def config(**keys):
        return validate({"model_name_or_path": "hp/tiny-llama", "dataset": "a.json", "dataset_dir": str(tmp_path),
                         "output_dir": str(tmp_path / "out"), **keys})

    for template in ("gemma2", "falcon"):
        with pytest.raises(ConfigError, match=rf"^train_on_prompt = true with template '{template}': an efficient_eos "
                                              r"template .*expected train_on_prompt: false, or a template without "
                                              r"efficient_eos \(not gemma2, falcon, glm4, glm4_moe, glm4_7, "
                                              r"glmz1, gpt_oss\)$"):
            _check_data(config(template=template, train_on_prompt=True), tokenizer(), None)
    _check_data(config(template="gemma2", mask_history=True), tokenizer(), None)  # fine without train_on_prompt
    with pytest.raises(ConfigError, match=r"^train_on_prompt = true with mask_history = true: .*expected at most one"):
        _check_data(config(train_on_prompt=True, mask_history=True), tokenizer(), None)
    for key in ("train_on_prompt", "mask_history"):
        with pytest.raises(ConfigError, match=rf"^{key} = true with stage 'pt': .*expected {key}: false, or stage"):
            _check_data(config(stage="pt", **{key: True}), tokenizer(), None)
    # the encoding refuses them to direct callers too
    with pytest.raises(ValueError, match=r"train_on_prompt = true with template 'falcon'"):
        encode_conversation(conversation("single"), tokenizer(), TEMPLATES["falcon"], train_on_prompt=True)


def test_data_arguments_of_the_wrong_type_are_refused():
    base = {"model_name_or_path": "hp/tiny-llama", "dataset": "d", "output_dir": "o"}
    with pytest.raises(ConfigError) as err:
        validate({**base, "train_on_prompt": "yes", "mask_history": 1, "enable_thinking": "false",
                  "preserve_thinking": None, "default_system": 3})
    assert str(err.value).splitlines() == [
        "5 problems in the config:",
        "  - default_system = 3: expected a string, or null",
        "  - train_on_prompt = 'yes': expected true or false",
        "  - mask_history = 1: expected true or false",
        "  - enable_thinking = 'false': expected true or false, or null",
        "  - preserve_thinking = None: expected true or false",
    ]
    # a system prompt is taken as written: its spaces and newlines are tokens
    assert validate({**base, "default_system": " Be brief.\n"}).default_system == " Be brief.\n"
    # the tool format is refused with its reason, unless at LlamaFactory's default
    with pytest.raises(ConfigError, match=r"tool_format = 'qwen' is not taken by hp train \(tool formats are not "
                                          r"available yet: a dataset's tools column is read and ignored"):
        validate({**base, "tool_format": "qwen"})
    validate({**base, "tool_format": None})
    # and the encoding's own entry points refuse them as well
    with pytest.raises(ValueError, match=r"enable_thinking = 'no': expected True or False or None"):
        configure(TEMPLATES["qwen3"], enable_thinking="no")
    with pytest.raises(ValueError, match=r"default_system = 1: expected a string"):
        configure(TEMPLATES["qwen3"], default_system=1)
    with pytest.raises(ValueError, match=r"mask_history = 'yes': expected true or false"):
        encode_conversation(conversation("single"), tokenizer(), TEMPLATES["qwen"], mask_history="yes")
