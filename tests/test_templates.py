"""Chat templates: hp's sft encoding gives LlamaFactory's ids and labels, template by template.

The proof is `goldens/templates.json`, written by `goldens/make_template_goldens.py`
with LlamaFactory's own code on the tokenizer of `goldens/golden_tokenizer.py`;
here hp encodes the same records and must give the same input_ids and labels.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from goldens.golden_tokenizer import CHAT_TEMPLATES, RECORDS, golden_tokenizer, messages
from hp.train.config import ConfigError, validate
from hp.train.data import build_examples
from hp.train.encoding import (
    IGNORE_INDEX, Conversation, check_template, encode_conversation, encode_prompt, get_template,
)
from hp.train.templates import TEMPLATES, Template
from hp.train.tokenizer import ByteTokenizer, HFTokenizer

ROOT = Path(__file__).parent.parent
GOLDENS = json.loads((Path(__file__).parent / "goldens" / "templates.json").read_text(encoding="utf-8"))
CASES = GOLDENS["cases"]


@cache
def tokenizer(chat_template: str | None = None) -> HFTokenizer:
    return HFTokenizer(golden_tokenizer(chat_template))


def conversation(record: str) -> Conversation:
    r = RECORDS[record]
    return Conversation([(role, text) for role, text in r["turns"]], r["system"])


def case_id(case: dict) -> str:
    return f"{case['template'] or 'chat_template:' + case['chat_template']}-{case['record']}-{case['cutoff_len']}"


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
    # the goldens test something: cut cases are cut, and answers are supervised
    assert all(len(c["input_ids"]) <= c["cutoff_len"] for c in CASES)
    assert all(any(label != IGNORE_INDEX for label in c["labels"]) for c in CASES)


def test_text_only_templates_give_the_same_ids_on_the_byte_tokenizer():
    """The embedded model's tokenizer is the goldens' one without the added tokens: text-only templates agree."""
    byte = ByteTokenizer()
    checked = 0
    for case in CASES:
        if case["template"] is None or TEMPLATES[case["template"]].required_tokens():
            continue
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
