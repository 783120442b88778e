"""Examples for the preference stages: chosen/rejected pairs (rm, dpo) and answers judged by a tag (kto).

These stages score one final answer to a prompt rather than learn every
answer of a conversation, so they are encoded as LlamaFactory's pairwise and
feedback processors do, not as sft (`hp.train.data.encoding.encode_conversation`).
The prompt is every turn before the last answer, template prefix and system
prompt included, earlier answers unsupervised; the answer is encoded as the
last turn, with the eos appended for an `efficient_eos` template
(LlamaFactory's `encode_oneturn`). `cutoff_len` is shared once between the
two (`fit_lengths`), each cut at its end. A pair shares one prompt and one
answer length, the longer answer's, so its two sides are cut alike.

A kto example carries a KL example too: its prompt answered by another
record's answer, which KTO scores to estimate how far the policy drifted
from the reference. LlamaFactory takes the previous record's answer within
each preprocessing batch (of 1000 records by default); `kl_answers` takes the
previous record's over the whole dataset (the first record takes the last
one's), so the pairing does not depend on a batch size.

`hp.train.data.records` reads the records, and `hp.train.data.tokenizing`
calls these on them. The example shapes (lists of ints; labels are -100 on
the prompt):

    rm, dpo  {"chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"}
    kto      {"input_ids", "labels", "kl_input_ids", "kl_labels", "kto_tag"}   kto_tag: True for a desirable answer
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hp.train.config.templates import Template
from hp.train.data.encoding import IGNORE_INDEX, Conversation, encode_pairs, eos_id, fit_lengths

if TYPE_CHECKING:
    from hp.train.data.tokenizer import Tokenizer

# The token lists of an example of any stage, each with its labels.
SIDES: dict[str, str] = {
    "input_ids": "labels", "chosen_ids": "chosen_labels", "rejected_ids": "rejected_labels",
    "kl_input_ids": "kl_labels",
}


def pairwise_example(
    conv: Conversation, chosen: str, rejected: str, tokenizer: Tokenizer, template: Template, cutoff_len: int,
    *, where: str = "the record",
) -> dict[str, list[int]]:
    """The rm/dpo example of `conv`, which ends with the user's turn, answered by `chosen` and by `rejected`.

    `where` names the record in errors.

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> from hp.train.config.templates import TEMPLATES
    >>> pairwise_example(Conversation([("user", "1+1")]), "2", "11", ByteTokenizer(), TEMPLATES["empty"], 16)
    {'chosen_ids': [49, 43, 49, 50], 'chosen_labels': [-100, -100, -100, 50], 'rejected_ids': [49, 43, 49, 49, 49], 'rejected_labels': [-100, -100, -100, 49, 49]}
    """
    if _last_role(conv) != "user":
        raise ValueError(f"{where}: the conversation ends with {_last_turn(conv)}; a ranking record's messages end "
                         "with the user's turn, which the chosen and rejected answers both answer (expected an odd "
                         "number of messages, alternating from the user's)")
    prompt, chosen_ids = _prompt_and_answer(conv, chosen, tokenizer, template)
    _, rejected_ids = _prompt_and_answer(conv, rejected, tokenizer, template)
    kept, answer_len = fit_lengths(len(prompt), max(len(chosen_ids), len(rejected_ids)), cutoff_len)
    chosen_ids, chosen_labels = _joined(prompt[:kept], chosen_ids[:answer_len])
    rejected_ids, rejected_labels = _joined(prompt[:kept], rejected_ids[:answer_len])
    return {"chosen_ids": chosen_ids, "chosen_labels": chosen_labels,
            "rejected_ids": rejected_ids, "rejected_labels": rejected_labels}


def feedback_answer(conv: Conversation, *, where: str = "the record") -> str:
    """The answer a kto record's tag judges: its conversation's last turn, which must be the assistant's.

    >>> feedback_answer(Conversation([("user", "1+1"), ("assistant", "2")]))
    '2'
    """
    if _last_role(conv) != "assistant":
        raise ValueError(f"{where}: the conversation ends with {_last_turn(conv)}; a kto record's messages end with "
                         "the answer its kto_tag judges (expected an even number of messages, the assistant's last)")
    return conv.turns[-1][1]


def feedback_example(
    conv: Conversation, kl_answer: str, desirable: bool, tokenizer: Tokenizer, template: Template, cutoff_len: int,
    *, where: str = "the record",
) -> dict[str, Any]:
    """The kto example of `conv` (its last turn the judged answer), with its KL example: the prompt and `kl_answer`.

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> from hp.train.config.templates import TEMPLATES
    >>> conv = Conversation([("user", "1+1"), ("assistant", "2")])
    >>> feedback_example(conv, "3", True, ByteTokenizer(), TEMPLATES["empty"], 16)
    {'input_ids': [49, 43, 49, 50], 'labels': [-100, -100, -100, 50], 'kl_input_ids': [49, 43, 49, 51], 'kl_labels': [-100, -100, -100, 51], 'kto_tag': True}
    """
    answer = feedback_answer(conv, where=where)
    prompt = Conversation(conv.turns[:-1], conv.system)
    ids, labels = _fitted(prompt, answer, tokenizer, template, cutoff_len)
    kl_ids, kl_labels = _fitted(prompt, kl_answer, tokenizer, template, cutoff_len)
    return {"input_ids": ids, "labels": labels, "kl_input_ids": kl_ids, "kl_labels": kl_labels, "kto_tag": desirable}


def kl_answers(answers: Sequence[str]) -> list[str]:
    """The answer each record's KL example takes: the previous record's, the first record the last one's.

    >>> kl_answers(["a", "b", "c"])
    ['c', 'a', 'b']
    """
    return [*answers[-1:], *answers[:-1]]


def sides(example: Mapping[str, Any]) -> list[tuple[list[int], list[int]]]:
    """The (ids, labels) lists an example of any stage holds: one (pt, sft), two (rm, dpo, kto with its KL side).

    >>> sides({"chosen_ids": [1, 2], "chosen_labels": [-100, 2], "rejected_ids": [1, 3], "rejected_labels": [-100, 3]})
    [([1, 2], [-100, 2]), ([1, 3], [-100, 3])]
    """
    return [(example[ids], example[labels]) for ids, labels in SIDES.items() if ids in example]


def keeps_supervision(example: Mapping[str, Any]) -> bool:
    """Whether every answer an example trains keeps a supervised token (both of a pair; a kto example's own,
    not its KL answer's, which is only scored).

    >>> keeps_supervision({"input_ids": [1], "labels": [-100], "kl_input_ids": [1, 2], "kl_labels": [-100, 2]})
    False
    """
    trained = [labels for ids, labels in SIDES.items() if ids in example and ids != "kl_input_ids"]
    return all(any(label != IGNORE_INDEX for label in example[labels]) for labels in trained)


def _prompt_and_answer(conv: Conversation, answer: str, tokenizer: Tokenizer,
                       template: Template) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of `conv` answered by `answer`, as LlamaFactory's `encode_oneturn` (plus
    the efficient_eos eos): every earlier turn joined into the prompt."""
    answered = Conversation([*conv.turns, ("assistant", answer)], conv.system)
    pairs = encode_pairs(answered, tokenizer, template, drop_history_thoughts=True)
    if template.thought is not None and template.preserve_thinking:
        # encode_oneturn leaves earlier answers as written then: no thought removed, no empty one added
        pairs[:-1] = encode_pairs(answered, tokenizer, dataclasses.replace(template, thought=None))[:-1]
    prompt = [i for p, a in pairs[:-1] for i in p + a] + pairs[-1][0]
    end = [eos_id(template, tokenizer)] if template.efficient_eos else []
    return prompt, pairs[-1][1] + end


def _fitted(conv: Conversation, answer: str, tokenizer: Tokenizer, template: Template,
            cutoff_len: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of `conv` answered by `answer`, prompt and answer cut to share `cutoff_len`."""
    prompt, answer_ids = _prompt_and_answer(conv, answer, tokenizer, template)
    kept, answer_len = fit_lengths(len(prompt), len(answer_ids), cutoff_len)
    return _joined(prompt[:kept], answer_ids[:answer_len])


def _joined(prompt: list[int], answer: list[int]) -> tuple[list[int], list[int]]:
    return prompt + answer, [IGNORE_INDEX] * len(prompt) + answer


def _last_role(conv: Conversation) -> str | None:
    return conv.turns[-1][0] if conv.turns else None


def _last_turn(conv: Conversation) -> str:
    return {"user": "the user's turn", "assistant": "an assistant turn"}.get(_last_role(conv), "no turn at all")
