"""The preference data of `hp train`: ranking pairs (rm, dpo) and kto feedback, encoded as LlamaFactory does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hp.train.config.templates import TEMPLATES, Template
from hp.train.data import ByteTokenizer, build_examples
from hp.train.data.encoding import IGNORE_INDEX, Conversation, encode_pairs, fit_lengths

TOK = ByteTokenizer()
EOS = TOK.eos_token_id
PAIR_COLUMNS = {"chosen": "chosen", "rejected": "rejected"}
ROLE_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}


def write_data(directory: Path, info: dict, files: dict[str, object]) -> Path:
    (directory / "dataset_info.json").write_text(json.dumps(info))
    for name, records in files.items():
        (directory / name).write_text(json.dumps(records))
    return directory


def side(prompt: list[int], answer: list[int]) -> tuple[list[int], list[int]]:
    return prompt + answer, [IGNORE_INDEX] * len(prompt) + answer


def pair(prompt: list[int], chosen: list[int], rejected: list[int]) -> dict[str, list[int]]:
    (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = side(prompt, chosen), side(prompt, rejected)
    return {"chosen_ids": chosen_ids, "chosen_labels": chosen_labels,
            "rejected_ids": rejected_ids, "rejected_labels": rejected_labels}


def default_user(text: str) -> list[int]:
    """A user turn of the `default` template: "Human: {text}" eos "\\nAssistant:"."""
    return TOK.encode(f"Human: {text}") + [EOS] + TOK.encode("\nAssistant:")


def default_answer(text: str) -> list[int]:
    return TOK.encode(text) + [EOS] + TOK.encode("\n")


# ---------------------------------------------------------------- rm, dpo


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_alpaca_pair_masks_the_whole_prompt_history_and_system_included(tmp_path, stage):
    columns = {**PAIR_COLUMNS, "system": "system", "history": "history"}
    record = {"instruction": "q", "input": "x", "chosen": "good", "rejected": "bad", "system": "sys",
              "history": [["h", "a"]]}
    d = write_data(tmp_path, {"p": {"file_name": "p.json", "ranking": True, "columns": columns}}, {"p.json": [record]})
    data = build_examples("p", d, TOK, stage=stage, template="default", cutoff_len=1024)
    system = TOK.encode("System: sys") + [EOS] + TOK.encode("\n")
    prompt = system + default_user("h") + default_answer("a") + default_user("q\nx")
    assert data.examples == [pair(prompt, default_answer("good"), default_answer("bad"))]
    tokens = 2 * len(prompt) + len(default_answer("good")) + len(default_answer("bad"))
    supervised = len(default_answer("good")) + len(default_answer("bad"))
    assert data.summary() == f"1 examples, {tokens} tokens, {supervised} supervised, 0 dropped"


def test_sharegpt_pair_with_custom_tags_and_a_system_message(tmp_path):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    record = {"messages": messages, "chosen": {"role": "assistant", "content": "yes"},
              "rejected": {"role": "assistant", "content": "no"}}
    info = {"s": {"file_name": "s.json", "formatting": "sharegpt", "ranking": True,
                  "columns": {"messages": "messages", **PAIR_COLUMNS}, "tags": {**ROLE_TAGS, "system_tag": "system"}}}
    d = write_data(tmp_path, info, {"s.json": [record]})
    data = build_examples("s", d, TOK, stage="dpo", template="alpaca")

    def user(text: str) -> list[int]:
        return TOK.encode(f"### Instruction:\n{text}\n\n### Response:\n")

    def answer(text: str) -> list[int]:
        return TOK.encode(text) + [EOS] + TOK.encode("\n\n")

    prompt = TOK.encode("sys") + user("u1") + answer("a1") + user("u2")
    assert data.examples == [pair(prompt, answer("yes"), answer("no"))]


def test_a_pair_shares_cutoff_len_by_its_longer_answer(tmp_path):
    record = {"instruction": "p" * 10, "chosen": "c" * 3, "rejected": "r" * 8}
    d = write_data(tmp_path, {"p": {"file_name": "p.json", "ranking": True, "columns": PAIR_COLUMNS}},
                   {"p.json": [record]})
    (example,) = build_examples("p", d, TOK, stage="rm", template="empty", cutoff_len=12).examples
    assert fit_lengths(10, 8, 12) == (7, 5)  # the rejected answer's length decides both sides' room
    assert example == pair(TOK.encode("p" * 7), TOK.encode("c" * 3), TOK.encode("r" * 5))


def test_efficient_eos_ends_each_answer_with_eos(tmp_path):
    assert TEMPLATES["falcon"].efficient_eos
    record = {"instruction": "q", "chosen": "good", "rejected": "bad"}
    d = write_data(tmp_path, {"p": {"file_name": "p.json", "ranking": True, "columns": PAIR_COLUMNS}},
                   {"p.json": [record]})
    (example,) = build_examples("p", d, TOK, stage="dpo", template="falcon").examples
    prompt = TOK.encode("User: q\nFalcon:")
    assert example == pair(prompt, TOK.encode("good\n") + [EOS], TOK.encode("bad\n") + [EOS])


def test_reasoning_template_drops_or_keeps_earlier_thoughts_as_encode_oneturn(tmp_path):
    think = Template("think", thought=("<think>\n", "\n</think>\n\n"))
    earlier = "<think>\nhm\n</think>\n\nA1"
    record = {"instruction": "q", "history": [["u", earlier]], "chosen": "B", "rejected": "C"}
    d = write_data(tmp_path, {"p": {"file_name": "p.json", "ranking": True,
                                    "columns": {**PAIR_COLUMNS, "history": "history"}}}, {"p.json": [record]})
    empty = TOK.encode("<think>\n\n</think>\n\n")
    for preserve, history in ((False, "A1"), (True, earlier)):
        (example,) = build_examples("p", d, TOK, stage="dpo", template=think, preserve_thinking=preserve).examples
        prompt = TOK.encode("u") + TOK.encode(history) + [EOS] + TOK.encode("q")
        assert example == pair(prompt, empty + TOK.encode("B") + [EOS], empty + TOK.encode("C") + [EOS])
    (example,) = build_examples("p", d, TOK, stage="dpo", template=think, enable_thinking=False).examples
    assert example == pair(TOK.encode("uA1") + [EOS] + TOK.encode("q") + empty, TOK.encode("B") + [EOS],
                           TOK.encode("C") + [EOS])


def test_a_pair_with_an_empty_answer_is_dropped(tmp_path):
    records = [{"instruction": "q", "chosen": "", "rejected": "bad"},
               {"instruction": "q", "chosen": "ok", "rejected": "no"}]
    d = write_data(tmp_path, {"p": {"file_name": "p.json", "ranking": True, "columns": PAIR_COLUMNS}},
                   {"p.json": records})
    data = build_examples("p", d, TOK, stage="dpo", template="empty")
    assert data.dropped == 1 and data.examples == [pair(TOK.encode("q"), TOK.encode("ok"), TOK.encode("no"))]
    assert data.summary() == "1 examples, 6 tokens, 4 supervised, 1 dropped"


# ---------------------------------------------------------------- kto


def test_kto_alpaca_pairs_each_prompt_with_the_previous_records_answer(tmp_path):
    records = [{"instruction": f"q{i}", "output": f"a{i}", "label": i != 1} for i in range(3)]
    info = {"k": {"file_name": "k.json", "columns": {"kto_tag": "label"}}}
    data = build_examples("k", write_data(tmp_path, info, {"k.json": records}), TOK, stage="kto", template="default")
    assert [e["kto_tag"] for e in data.examples] == [True, False, True]
    for i, example in enumerate(data.examples):
        ids, labels = side(default_user(f"q{i}"), default_answer(f"a{i}"))
        kl_ids, kl_labels = side(default_user(f"q{i}"), default_answer(f"a{(i - 1) % 3}"))
        assert example == {"input_ids": ids, "labels": labels, "kl_input_ids": kl_ids, "kl_labels": kl_labels,
                           "kto_tag": i != 1}
    assert data.dropped == 0 and data.summary().startswith("3 examples")


def test_kto_sharegpt_with_custom_tags_and_efficient_eos(tmp_path):
    def record(question: str, answer: str, good: bool) -> dict:
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                "label": good}

    info = {"k": {"file_name": "k.json", "formatting": "sharegpt",
                  "columns": {"messages": "messages", "kto_tag": "label"}, "tags": ROLE_TAGS}}
    d = write_data(tmp_path, info, {"k.json": [record("1+1", "2", True), record("2+2", "5", False)]})
    data = build_examples("k", d, TOK, stage="kto", template="falcon")
    conv = Conversation([("user", "2+2"), ("assistant", "5")])
    ((prompt, answer),) = encode_pairs(conv, TOK, TEMPLATES["falcon"])
    second = data.examples[1]
    assert (second["input_ids"], second["labels"]) == side(prompt, answer + [EOS])
    assert (second["kl_input_ids"], second["kl_labels"]) == side(prompt, TOK.encode("2\n") + [EOS])
    assert [e["kto_tag"] for e in data.examples] == [True, False]


def test_kto_drops_an_empty_answer_but_not_an_empty_kl_answer(tmp_path):
    records = [{"instruction": "q0", "output": "", "label": True}, {"instruction": "q1", "output": "a", "label": False}]
    info = {"k": {"file_name": "k.json", "columns": {"kto_tag": "label"}}}
    data = build_examples("k", write_data(tmp_path, info, {"k.json": records}), TOK, stage="kto", template="empty")
    assert data.dropped == 1
    assert data.examples == [{"input_ids": TOK.encode("q1a"), "labels": [IGNORE_INDEX, IGNORE_INDEX, ord("a")],
                              "kl_input_ids": TOK.encode("q1"), "kl_labels": [IGNORE_INDEX] * 2, "kto_tag": False}]


def test_kto_in_worker_processes_gives_the_same_examples(tmp_path, monkeypatch):
    from hp.train.data import tokenizing

    monkeypatch.setattr(tokenizing, "PROBE", 8)  # a pool, however little it would save
    monkeypatch.setattr(tokenizing, "POOL_START_S", 0.0)
    records = [{"instruction": f"q{i}", "output": f"a{i}", "label": i % 3 == 0} for i in range(40)]
    d = write_data(tmp_path, {"k": {"file_name": "k.json", "columns": {"kto_tag": "label"}}}, {"k.json": records})
    one = build_examples("k", d, TOK, stage="kto", template="default")
    two = build_examples("k", d, TOK, stage="kto", template="default", workers=2)
    assert two.examples == one.examples and len(one) == 40


# ---------------------------------------------------------------- bad input


RANKED = {"p": {"file_name": "p.json", "ranking": True, "columns": PAIR_COLUMNS}}
PAIRS = {"p.json": [{"instruction": "q", "chosen": "a", "rejected": "b"}]}
PLAIN = {"a": {"file_name": "a.json"}}
ANSWERS = {"a.json": [{"instruction": "q", "output": "a", "label": True}]}
TAGGED = {"a": {"file_name": "a.json", "columns": {"kto_tag": "label"}}}
SHAREGPT_PAIR = {"p": {"file_name": "p.json", "formatting": "sharegpt", "ranking": True, "columns": PAIR_COLUMNS}}
SHAREGPT_TAGGED = {"a": {"file_name": "a.json", "formatting": "sharegpt", "columns": {"kto_tag": "label"}}}


def human(text: str) -> dict:
    return {"from": "human", "value": text}


def gpt(text: str) -> dict:
    return {"from": "gpt", "value": text}


@pytest.mark.parametrize("info, files, stage, message", [
    (RANKED, PAIRS, "sft", r"dataset 'p' \(.*p.json\): a ranking dataset \(\"ranking\": true in dataset_info.json: "
                           r"chosen and rejected answers\) is read by stages rm and dpo, not sft; expected stage: rm "
                           r"or dpo, or a dataset without it"),
    (RANKED, PAIRS, "pt", r"is read by stages rm and dpo, not pt"),
    (RANKED, PAIRS, "kto", r"not kto; expected a dataset without \"ranking\": true and with a kto_tag column, since "
                           r"kto reads one answer a record"),
    (PLAIN, ANSWERS, "dpo", r"dataset 'a' \(.*a.json\): stage dpo trains on chosen and rejected answers, and this is "
                            r"not a ranking dataset; expected \"ranking\": true in dataset_info.json and columns "
                            r"chosen and rejected in its entry"),
    ({"p": {"file_name": "p.json", "ranking": True, "columns": {"rejected": "rejected"}}}, PAIRS, "rm",
     r"dataset 'p' \(.*\): a ranking dataset needs its chosen column named in dataset_info.json, as LlamaFactory "
     r"gives neither a default"),
    ({"p": {"file_name": "p.json", "ranking": True, "columns": {**PAIR_COLUMNS, "chosen": "better"}}}, PAIRS, "dpo",
     r"column 'better' \(the chosen, named in dataset_info.json\) is in no record"),
    (RANKED, {"p.json": PAIRS["p.json"] + [{"instruction": "q", "rejected": "b"}]}, "dpo",
     r"dataset 'p' \(.*p.json, record 1\): no column 'chosen' \(the chosen\)"),
    (RANKED, {"p.json": [{"instruction": "q", "chosen": None, "rejected": "b"}]}, "dpo",
     r"record 0\): column 'chosen' \(the chosen answer\) must be a string, got NoneType"),
    (SHAREGPT_PAIR, {"p.json": [{"conversations": [human("u"), gpt("a")], "chosen": gpt("c"), "rejected": gpt("r")}]},
     "dpo", r"dataset 'p' \(.*p.json, record 0\): the conversation ends with an assistant turn; a ranking record's "
            r"messages end with the user's turn"),
    (SHAREGPT_PAIR, {"p.json": [{"conversations": [human("u")], "chosen": human("c"), "rejected": gpt("r")}]}, "dpo",
     r"record 0\): the chosen message \(column 'chosen'\) has from='human', expected one of 'gpt', 'function_call'"),
    (SHAREGPT_PAIR, {"p.json": [{"conversations": [human("u")], "chosen": "c", "rejected": gpt("r")}]}, "dpo",
     r"record 0\): the chosen message \(column 'chosen'\) must be an object with keys 'from' and 'value'"),
    (PLAIN, ANSWERS, "kto", r"dataset 'a' \(.*a.json\): stage kto trains on answers judged desirable or not; "
                            r"expected a kto_tag column \(true or false\) named in its dataset_info.json entry"),
    (TAGGED, ANSWERS, "sft", r"dataset 'a' \(.*\): its kto_tag column \('label'\) is read by stage kto only, not sft"),
    (TAGGED, {"a.json": [{"instruction": "q", "output": "a", "label": "yes"}]}, "kto",
     r"record 0\): column 'label' \(the kto_tag\) must be true or false, got 'yes'"),
    (SHAREGPT_TAGGED, {"a.json": [{"conversations": [human("u"), gpt("a")], "label": True},
                                  {"conversations": [human("u")], "label": False}]}, "kto",
     r"dataset 'a' \(.*a.json, record 1\): the conversation ends with the user's turn; a kto record's messages end "
     r"with the answer its kto_tag judges"),
    ({"p": {**RANKED["p"], "columns": {**PAIR_COLUMNS, "images": "images"}}},
     {"p.json": [{**PAIRS["p.json"][0], "images": ["x.png"]}]}, "dpo",
     r"dataset 'p' \(.*\): its records have images \(column 'images'\); hp train reads images in sft data only, not "
     r"in preference data \(stage dpo\)"),
    ({"p": {**RANKED["p"], "ranking": "yes"}}, PAIRS, "dpo", r"dataset 'p' in .*: ranking must be true or false"),
])
def test_bad_preference_input_is_a_clear_error(tmp_path, info, files, stage, message):
    d = write_data(tmp_path, info, files)
    with pytest.raises(ValueError, match=message):
        build_examples(list(info), d, TOK, stage=stage, template="empty")


@pytest.mark.parametrize("stage, key", [("dpo", "train_on_prompt"), ("rm", "mask_history"), ("kto", "train_on_prompt")])
def test_sft_supervision_options_are_refused_in_preference_stages(tmp_path, stage, key):
    d = write_data(tmp_path, RANKED, PAIRS)
    with pytest.raises(ValueError, match=rf"{key} = true with stage '{stage}': {stage} supervises the final answer "
                                         rf"only, its prompt masked, and LlamaFactory ignores {key} there"):
        build_examples("p", d, TOK, stage=stage, **{key: True})


def test_every_pair_dropped_is_an_error(tmp_path):
    d = write_data(tmp_path, RANKED, {"p.json": [{"instruction": "q", "chosen": "", "rejected": "b"}]})
    with pytest.raises(ValueError, match="no example left: none of the 1 examples keeps a supervised token"):
        build_examples("p", d, TOK, stage="dpo", template="empty")
