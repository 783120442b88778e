"""The data layer of `hp train`: tokenizers, LlamaFactory dataset formats, labels, packing, batches."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hp.train.config.templates import TEMPLATES
from hp.train.data import (
    IGNORE_INDEX, ByteTokenizer, Conversation, HFTokenizer, TokenBatches, build_examples, collate,
    encode_conversation, encode_prompt, load_examples, load_tokenizer, quickstart, quickstart_preference,
    quickstart_vl,
)
from hp.train.data.images import load_image

ROOT = Path(__file__).parent.parent
TOK = ByteTokenizer()


def write_data(directory: Path, info: dict | str | None, files: dict[str, object]) -> Path:
    """A dataset_dir: `info` as dataset_info.json (a str is written raw), `files` as JSON (str raw)."""
    directory.mkdir(parents=True, exist_ok=True)
    if info is not None:
        (directory / "dataset_info.json").write_text(info if isinstance(info, str) else json.dumps(info))
    for name, content in files.items():
        (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return directory


def supervised_text(example: dict) -> str:
    return TOK.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label != IGNORE_INDEX])


def masked_text(example: dict) -> str:
    return TOK.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label == IGNORE_INDEX])


# ---------------------------------------------------------------- tokenizers


@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids + [TOK.eos_token_id, TOK.pad_token_id]) == text


def test_byte_tokenizer_ids_and_replacement():
    assert (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id, TOK.vocab_size) == (256, 257, 258, 259)
    assert TOK.decode([0xE2, 0x82]) == "\ufffd"  # a cut multi-byte character does not raise
    assert TOK.decode([104, 300, 105]) == "hi"  # ids past the bytes (padded vocab rows) carry no text


def test_local_hf_tokenizer_is_wrapped(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        tmp_path
    )
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [3, 4]  # no special tokens added
    # pad falls back to eos
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, tok.vocab_size) == (2, 2, 1, 5)
    assert tok.decode([1, 3, 2]) == "hello"


@pytest.fixture(scope="module")
def fast_tokenizers():
    """BPE tokenizers with special and added tokens, a bos post-processor, truncation and padding set in the
    Rust tokenizer, special tokens split or not: what `HFTokenizer.encode` must not apply or must follow."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    records = json.loads((ROOT / "examples" / "data" / "quickstart.json").read_text())
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator([" ".join(r.values()) for r in records[:200]],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|im_end|>"]))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    bpe.enable_truncation(8)
    bpe.enable_padding(length=16, pad_id=0)
    made = []
    for split in (False, True):
        hf = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                     split_special_tokens=split)
        hf.add_tokens(["<think>"])
        ours = HFTokenizer(hf)  # wrapped before hf.encode turns the truncation off in place
        made += [(ours, hf), (pickle.loads(pickle.dumps(ours)), hf)]  # as worker processes that tokenize get it
    return made


@given(st.lists(st.sampled_from(["Uppercase", " abc", "<|im_end|>", "</s>", "<think>", "\n", "  ", "é", "<s"]),
                max_size=12))
def test_a_fast_tokenizer_encodes_as_its_own_encode(fast_tokenizers, parts):
    text = "".join(parts)
    for ours, hf in fast_tokenizers:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), (text, hf.split_special_tokens)


def test_load_tokenizer_errors(tmp_path):
    assert isinstance(load_tokenizer("hp/tiny-llama"), ByteTokenizer)
    with pytest.raises(ValueError, match=r"'org/model' is neither 'hp/tiny-llama' nor a local dir.*never downloads"):
        load_tokenizer("org/model")
    with pytest.raises(ValueError, match=r"holds no HF tokenizer \(none of tokenizer.json, tokenizer_config.json\)"):
        load_tokenizer(str(tmp_path))


# ---------------------------------------------------------------- sft


def test_alpaca_sft_supervises_exactly_the_response(tmp_path):
    records = [
        {"instruction": "add", "input": "1 2", "output": "3"},
        {"instruction": "hi", "output": "yo", "sys": "be brief", "hist": [["q1", "a1"]]},
    ]
    info = {"d": {"file_name": "d.json", "columns": {"system": "sys", "history": "hist"}}}
    data = build_examples("d", write_data(tmp_path, info, {"d.json": records}), TOK, template="default",
                          cutoff_len=128)
    first, second = data[0], data[1]
    # LlamaFactory's default template: no bos; eos ends the user's and the system's text as well as each answer
    assert first["input_ids"][0] == ord("H") and first["input_ids"][-2:] == [TOK.eos_token_id, ord("\n")]
    assert TOK.decode(first["input_ids"]) == "Human: add\n1 2\nAssistant:3\n"
    assert masked_text(first) == "Human: add\n1 2\nAssistant:"
    assert supervised_text(first) == "3\n" and first["labels"][-2] == TOK.eos_token_id
    # history answers are supervised too; the system prompt and every user turn are not
    assert masked_text(second) == "System: be brief\nHuman: q1\nAssistant:Human: hi\nAssistant:"
    assert supervised_text(second) == "a1\nyo\n"
    assert second["labels"].count(TOK.eos_token_id) == 2 and second["input_ids"].count(TOK.eos_token_id) == 5
    assert len(first["input_ids"]) == len(first["labels"])


ALPACA_SYSTEM = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"


@pytest.mark.parametrize("template, prompt, answer", [
    (None, "add\n1 2", "3"),  # unset: the byte tokenizer has no chat_template, so `empty` (no eos at all)
    ("empty", "add\n1 2", "3"),
    ("alpaca", ALPACA_SYSTEM + "### Instruction:\nadd\n1 2\n\n### Response:\n", "3\n\n"),
    ("mistral", "[INST] add\n1 2[/INST]", " 3"),
])
def test_other_templates(tmp_path, template, prompt, answer):
    d = write_data(tmp_path, None, {"a.json": [{"instruction": "add", "input": "1 2", "output": "3"}]})
    (example,) = build_examples("a.json", d, TOK, template=template).examples
    assert masked_text(example) == prompt and supervised_text(example) == answer
    assert TOK.decode(encode_prompt("add\n1 2", TOK, template)) == prompt  # generation sees the same prompt


def test_sharegpt_multi_turn_supervises_every_assistant_turn(tmp_path):
    default_tags = {"conversations": [
        {"from": "human", "value": "u1"}, {"from": "gpt", "value": "a1"},
        {"from": "human", "value": "u2"}, {"from": "gpt", "value": "a2"},
    ], "system": "s"}
    openai_style = {"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"},
    ]}
    info = {
        "share": {"file_name": "s.json", "formatting": "sharegpt",
                  "columns": {"messages": "conversations", "system": "system"}},
        "oai": {"file_name": "o.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
                "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                         "assistant_tag": "assistant", "system_tag": "system"}},
    }
    d = write_data(tmp_path, info, {"s.json": [default_tags], "o.jsonl": json.dumps(openai_style) + "\n\n"})
    data = build_examples("share, oai", d, TOK, template="default")
    assert len(data) == 2 and data[0] == data[1]  # both spellings mean the same conversation
    example = data[0]
    assert masked_text(example) == "System: s\nHuman: u1\nAssistant:Human: u2\nAssistant:"
    assert supervised_text(example) == "a1\na2\n"
    ends = [i for i, t in enumerate(example["input_ids"]) if t == TOK.eos_token_id]
    assert len(ends) == 5 and [example["labels"][i] == TOK.eos_token_id for i in ends] == [0, 0, 1, 0, 1]


def test_truncation_shares_cutoff_len_and_drops_what_has_no_answer(tmp_path):
    records = [{"instruction": "x" * 10, "output": "y" * 30}, {"instruction": "z" * 40, "output": "w"},
               {"instruction": "q", "output": ""}]
    d = write_data(tmp_path, None, {"a.json": records})
    data = build_examples("a.json", d, TOK, template="empty", cutoff_len=20)
    assert len(data) == 2 and data.dropped == 1  # the empty answer has nothing to supervise (`empty` has no eos)
    long_answer, long_prompt = data.examples
    assert len(long_answer["input_ids"]) == len(long_answer["labels"]) == 20
    # as LlamaFactory's infer_seqlen: both long, each keeps its share (30/40 of 20); a short answer stays whole
    assert masked_text(long_answer) == "x" * 5 and supervised_text(long_answer) == "y" * 15
    assert masked_text(long_prompt) == "z" * 19 and supervised_text(long_prompt) == "w"
    assert "2 examples" in data.summary() and "1 dropped" in data.summary()


# ---------------------------------------------------------------- pt


def test_pt_packs_documents_into_cutoff_blocks(tmp_path):
    docs = [{"text": "a" * 30}, {"text": "b" * 7}, {"text": "c" * 20}]
    d = write_data(tmp_path, {"t": {"file_name": "t.json", "columns": {"prompt": "text"}}}, {"t.json": docs})
    blocks = build_examples("t", d, TOK, stage="pt", cutoff_len=16).examples
    total = sum(len(r["text"]) + 2 for r in docs)  # bos + text + eos each
    assert [len(b["input_ids"]) for b in blocks] == [16] * (total // 16) + [total % 16]
    assert all(b["labels"] == b["input_ids"] for b in blocks)  # everything supervised
    stream = [t for b in blocks for t in b["input_ids"]]
    assert stream.count(TOK.eos_token_id) == 3 and TOK.decode(stream) == "a" * 30 + "b" * 7 + "c" * 20
    # without dataset_info.json and columns, a "text" key is read as well
    bare = write_data(tmp_path / "bare", None, {"t.jsonl": "\n".join(json.dumps(r) for r in docs)})
    assert build_examples("t.jsonl", bare, TOK, stage="pt", cutoff_len=16).examples == blocks


def test_pt_on_alpaca_records_reads_prompt_and_response(tmp_path):
    d = write_data(tmp_path, None, {"a.json": [{"instruction": "q", "input": "i", "output": "r"}]})
    (block,) = build_examples("a.json", d, TOK, stage="pt").examples
    assert TOK.decode(block["input_ids"]) == "q\ni\nr"


# ---------------------------------------------------------------- batches


def toy_examples(n: int) -> list[dict]:
    return [{"input_ids": [i] * (1 + i % 4), "labels": [i] * (1 + i % 4)} for i in range(n)]


def draw(batches: TokenBatches, n: int) -> list[list[list[int]]]:
    return [next(batches)[0].tolist() for _ in range(n)]


def test_collate_pads_right():
    ids, labels = collate(toy_examples(3), pad_id=TOK.pad_token_id)
    assert ids.dtype == labels.dtype == torch.long and ids.shape == (3, 3)
    assert ids[0].tolist() == [0, 256, 256] and labels[0].tolist() == [0, -100, -100]


def test_batches_are_seeded_shuffles_of_full_batches():
    examples = toy_examples(10)
    one, same, other = (TokenBatches(examples, 3, seed, 256) for seed in (1, 1, 2))
    assert len(one) == 3  # 10 // 3: every batch is full
    first = draw(one, 6)
    assert first == draw(same, 6) and first != draw(other, 6)
    for epoch in (first[:3], first[3:]):
        seen = [row[0] for batch in epoch for row in batch]
        assert len(set(seen)) == 9  # an epoch draws distinct examples
    assert first[:3] != first[3:]  # and each epoch has its own order
    assert one.state_dict()["epoch"] == 2 and one.state_dict()["index"] == 0


def test_batches_resume_exactly():
    examples = toy_examples(11)
    straight = TokenBatches(examples, 2, 7, 256)
    expected = draw(straight, 12)  # crosses two epoch boundaries (5 batches each)
    for stop in (0, 3, 5, 7):
        run = TokenBatches(examples, 2, 7, 256)
        draw(run, stop)
        state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint stores it
        resumed = TokenBatches(examples, 2, 7, 256)
        resumed.load_state_dict(state)
        assert draw(resumed, 12 - stop) == expected[stop:]


def test_batch_errors():
    with pytest.raises(ValueError, match="3 examples cannot fill one batch of 4"):
        TokenBatches(toy_examples(3), 4, 0, 256)
    saved = TokenBatches(toy_examples(8), 2, 0, 256).state_dict()
    with pytest.raises(ValueError, match="cannot resume the batch stream: seed 0 -> 1, num_examples 8 -> 9"):
        TokenBatches(toy_examples(9), 2, 1, 256).load_state_dict(saved)


# ---------------------------------------------------------------- bad input


GOOD = [{"instruction": "i", "output": "o"}]


@pytest.mark.parametrize("info, files, dataset, message", [
    ({"a": {"file_name": "a.json"}, "b": {"file_name": "a.json"}}, {"a.json": GOOD}, "c",
     r"dataset 'c' is not in .*dataset_info.json; known: a, b"),
    (None, {}, "nothing.json", r"dataset 'nothing.json': .* has no dataset_info.json and no file .*nothing.json"),
    ({"a": {"file_name": "missing.json"}}, {}, "a", r"dataset 'a': file .*missing.json does not exist"),
    ('{"a": {"file_name": "a.json",}}', {}, "a", r"dataset_info.json in .*: bad JSON in .* at line 1 column 30"),
    ({"a": {"file_name": "a.json"}}, {"a.json": '[{"instruction": "i"'}, "a",
     r"dataset 'a': bad JSON in .*a.json at line 1 column 21: Expecting"),
    ({"a": {"file_name": "a.jsonl"}}, {"a.jsonl": '{"instruction": "i", "output": "o"}\n{oops}\n'}, "a",
     r"dataset 'a': bad JSON in .*a.jsonl at line 2"),
    ({"a": {"file_name": "a.json", "formatting": "chatml"}}, {"a.json": GOOD}, "a",
     r"dataset 'a' in .*: formatting 'chatml' is not one of alpaca, sharegpt"),
    ({"a": {"file_name": "a.json"}}, {"a.json": GOOD + [{"question": "q", "output": "o"}]}, "a",
     r"dataset 'a' \(.*a.json, record 1\): no column 'instruction' \(the prompt\); the record has 'question', 'output'"),
    ({"a": {"file_name": "a.json"}}, {"a.json": [{"instruction": "i"}]}, "a",
     r"record 0\): no column 'output' \(the response\)"),
    ({"a": {"file_name": "a.json", "columns": {"promt": "q"}}}, {"a.json": GOOD}, "a",
     r"columns: unsupported key\(s\) 'promt'; allowed: prompt, query, response, system, history"),
    ({"a": {"file_name": "a.json", "columns": {"system": "sys"}}}, {"a.json": GOOD}, "a",
     r"column 'sys' \(the system, named in dataset_info.json\) is in no record"),
    ({"a": {"hf_hub_url": "org/data"}}, {}, "a", r"it names only hf_hub_url, and hp downloads nothing"),
    ({"a": {"file_name": "a.json"}}, {"a.json": {"instruction": "i"}}, "a",
     r"expected a JSON list of records, got dict"),
    ({"a": {"file_name": "a.csv"}}, {"a.csv": "instruction,output\n"}, "a", r"only .json and .jsonl files are read"),
    ({"s": {"file_name": "s.json", "formatting": "sharegpt"}},
     {"s.json": [{"conversations": [{"from": "human", "value": "u"}, {"from": "human", "value": "u"}]}]}, "s",
     r"record 0\): message 1 has from='human', expected one of 'gpt', 'function_call'"),
    ({"s": {"file_name": "s.json", "formatting": "sharegpt"}},
     {"s.json": [{"conversations": [{"role": "user", "content": "u"}]}]}, "s",
     r"message 0 must be an object with keys 'from' and 'value' \(set tags.role_tag"),
    ({"s": {"file_name": "s.json", "formatting": "sharegpt"}},
     {"s.json": [{"conversations": [{"from": "human", "value": "u"}]}]}, "s",
     r"record 0\): the conversation ends with a user turn"),
    ({"a": {"file_name": "a.json"}}, {"a.json": [{"instruction": "prompt", "output": ""}]}, "a",
     r"no example left: none of the 1 examples keeps a supervised token within cutoff_len=8"),
    ({"a": {"file_name": "a.json"}}, {"a.json": GOOD}, " , ", r"no dataset named"),
])
def test_bad_input_is_a_clear_error(tmp_path, info, files, dataset, message):
    d = write_data(tmp_path, info, files)
    with pytest.raises(ValueError, match=message):
        build_examples(dataset, d, TOK, cutoff_len=8)


def test_bad_stage_template_and_pt_on_sharegpt(tmp_path):
    d = write_data(tmp_path, {"s": {"file_name": "s.json", "formatting": "sharegpt"}},
                   {"s.json": [{"conversations": [{"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]}]})
    with pytest.raises(ValueError, match="stage 'ppo' is not one of pt, sft, rm, dpo, kto"):
        build_examples("s", d, TOK, stage="ppo")
    with pytest.raises(ValueError, match="template 'llama30' is unknown; known: default, empty, alpaca, chatml"):
        build_examples("s", d, TOK, template="llama30")
    with pytest.raises(ValueError, match=r"dataset 's' \(.*s.json\): stage pt reads plain text; the sharegpt"):
        build_examples("s", d, TOK, stage="pt")


# ---------------------------------------------------------------- quickstart


def test_quickstart_files_load_and_are_reproducible(tmp_path):
    data_dir = ROOT / "examples" / "data"
    config = SimpleNamespace(dataset="quickstart", dataset_dir=str(data_dir), stage="sft", template="default",
                             cutoff_len=64, max_samples=None)
    data = load_examples(config, load_tokenizer("hp/tiny-llama"))
    assert len(data) == 2000 and data.dropped == 0
    assert max(len(e["input_ids"]) for e in data.examples) <= 48
    prompt = masked_text(data[0])
    word = prompt.split("\n")[1]
    assert prompt == f"Human: uppercase\n{word}\nAssistant:" and supervised_text(data[0]) == word.upper() + "\n"
    quickstart.write(tmp_path, 2000, 0)  # what examples/make_quickstart_data.py writes
    quickstart_vl.write(tmp_path, 200, 0)  # and `make_quickstart_data.py vl`, in any order
    quickstart_preference.write(tmp_path, 2000, 0)  # and `make_quickstart_data.py dpo`
    for name in ("quickstart.json", "quickstart_vl.json", "quickstart_dpo.json", "quickstart_kto.json",
                 "dataset_info.json"):
        assert (tmp_path / name).read_bytes() == (data_dir / name).read_bytes()
    for png in sorted((data_dir / "quickstart_vl").iterdir()):  # the same pictures, whatever zlib compressed them
        assert load_image(str(png)).tobytes() == load_image(str(tmp_path / "quickstart_vl" / png.name)).tobytes()
    assert len(list((tmp_path / "quickstart_vl").iterdir())) == 200
    assert (data_dir / "quickstart.json").stat().st_size < 300_000
    assert (data_dir / "quickstart_dpo.json").stat().st_size < 300_000
    vl_bytes = sum(f.stat().st_size for f in (data_dir / "quickstart_vl").iterdir())
    assert vl_bytes + (data_dir / "quickstart_vl.json").stat().st_size < 100_000


def test_encode_conversation_matches_the_loader():
    conv = Conversation([("user", "uppercase\nabc"), ("assistant", "ABC")])
    ids, labels = encode_conversation(conv, TOK, TEMPLATES["default"])
    prompt = encode_prompt("uppercase\nabc", TOK, "default")
    assert ids[: len(prompt)] == prompt and labels[: len(prompt)] == [IGNORE_INDEX] * len(prompt)
    assert labels[len(prompt):] == TOK.encode("ABC") + [TOK.eos_token_id] + TOK.encode("\n")



def test_tokenizing_in_worker_processes_gives_the_same_examples_in_order(monkeypatch):
    from hp.train.data import ByteTokenizer, build_examples, tokenizing

    # a pool, however little it would save: 8 records timed here, the rest in the workers
    monkeypatch.setattr(tokenizing, "PROBE", 8)
    monkeypatch.setattr(tokenizing, "POOL_START_S", 0.0)
    for stage in ("sft", "pt"):
        one = build_examples("quickstart", ROOT / "examples" / "data", ByteTokenizer(), stage=stage, template="alpaca", cutoff_len=48,
                             max_samples=300)
        three = build_examples("quickstart", ROOT / "examples" / "data", ByteTokenizer(), stage=stage, template="alpaca", cutoff_len=48,
                               max_samples=300, workers=3)
        assert three.examples == one.examples and three.dropped == one.dropped


def test_the_launcher_hands_its_splits_to_its_workers_for_the_same_data_settings(tmp_path, monkeypatch):
    from hp.train.data import splits

    monkeypatch.setenv(splits.SPLITS_ENV, "")  # hand_over sets it: restored after the test
    config = SimpleNamespace(dataset="quickstart", dataset_dir=ROOT / "examples" / "data", stage="sft",
                             template="default", cutoff_len=64, max_samples=40, val_size=0.1, eval_dataset=None,
                             seed=0)
    made = splits.load_splits(config, TOK)
    splits.hand_over(made, config, str(tmp_path))
    monkeypatch.setattr(splits, "load_examples", lambda *a: pytest.fail("tokenized again"))
    handed = splits.load_splits(config, TOK)
    assert [part.examples for part in handed] == [part.examples for part in made]
    other = SimpleNamespace(**{**vars(config), "cutoff_len": 32})  # other settings: their own examples
    with pytest.raises(pytest.fail.Exception, match="tokenized again"):
        splits.load_splits(other, TOK)
