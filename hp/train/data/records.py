"""A dataset's records read as what the stages train on: conversations, documents, pairs and judged answers.

Each reader takes one record (a JSON object) and the `DatasetSpec` that says
how its columns are named (`hp.train.data.dataset_info`):

- an alpaca record is a conversation of its history pairs, then its prompt
  (a newline and its query after it, when there is one) and its response;
  a sharegpt record is its messages, turns alternating user (observation
  turns count as user) and assistant (function calls count as assistant),
  a leading system message taking the place of the system column;
- stage pt reads plain text: an alpaca record gives its prompt, query and
  response columns that are present, joined by newlines (so `"columns":
  {"prompt": "text"}` reads a `text` column, as in LlamaFactory), or,
  lacking the prompt column, its `text` key; sharegpt is refused for pt, as
  in LlamaFactory;
- stages rm and dpo read a ranking record: in alpaca, the two answers'
  strings, after the prompt, query, system and history columns (no
  response column); in sharegpt, one message object each, read with the
  dataset's tags (an assistant or function_call role), answering messages
  that end with the user's turn;
- stage kto reads one answer a record (alpaca's response, sharegpt's last
  message) judged by the bool column `kto_tag` (true: desirable);
- a record's images column names its image files (`record_images`).

A record that does not read so (a missing column, a value of the wrong
type, a conversation whose roles do not alternate) is a ValueError naming
the dataset, file and record: training on silently skipped data hides
configuration mistakes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hp.train.data.dataset_info import INFO_FILE, DatasetSpec
from hp.train.data.encoding import Conversation


def _column(record: Mapping[str, Any], spec: DatasetSpec, role: str, index: int, *, required: bool) -> Any:
    """The value of the column playing `role`, or None when the column is absent and optional."""
    key = spec.columns.get(role)
    if key is None:
        return None
    if key not in record:
        if required:
            raise ValueError(
                f"{spec.where(index)}: no column {key!r} (the {role}); the record has {', '.join(map(repr, record))}"
            )
        return None
    return record[key]


def _text(value: Any, spec: DatasetSpec, what: str, index: int) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{spec.where(index)}: {what} must be a string, got {type(value).__name__}")
    return value


def alpaca_conversation(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> Conversation:
    """An alpaca record as a conversation: history pairs, then prompt (+ newline + query) and response.

    >>> from pathlib import Path
    >>> alpaca_conversation({"instruction": "add", "input": "1 2", "output": "3"}, DatasetSpec("d", Path("d.json")))
    Conversation(turns=[('user', 'add\\n1 2'), ('assistant', '3')], system='')
    """
    asked = _alpaca_prompt(record, spec, index)
    response = _text(_column(record, spec, "response", index, required=True), spec, "the response", index)
    return Conversation([*asked.turns, ("assistant", response)], asked.system)


def _alpaca_prompt(record: Mapping[str, Any], spec: DatasetSpec, index: int) -> Conversation:
    """An alpaca record's conversation up to its answer: history pairs, then prompt (+ newline + query)."""
    prompt = _text(_column(record, spec, "prompt", index, required=True), spec, "the prompt", index)
    query = _text(_column(record, spec, "query", index, required=False), spec, "the query", index)
    system = _text(_column(record, spec, "system", index, required=False), spec, "the system prompt", index)
    turns: list[tuple[str, str]] = []
    for pair in _column(record, spec, "history", index, required=False) or []:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise ValueError(f"{spec.where(index)}: history must be a list of [prompt, response] string pairs")
        turns += [("user", pair[0]), ("assistant", pair[1])]
    turns.append(("user", f"{prompt}\n{query}" if query else prompt))
    return Conversation(turns, system)


def sharegpt_conversation(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> Conversation:
    """A sharegpt record as a conversation; observation turns count as user, function calls as assistant.

    >>> from pathlib import Path
    >>> from hp.train.data.dataset_info import SHAREGPT_COLUMNS
    >>> spec = DatasetSpec("d", Path("d.json"), "sharegpt", SHAREGPT_COLUMNS)
    >>> msgs = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    >>> sharegpt_conversation({"conversations": msgs}, spec).turns
    [('user', 'hi'), ('assistant', 'hello')]
    """
    messages = _column(record, spec, "messages", index, required=True)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{spec.where(index)}: {spec.columns['messages']!r} must be a non-empty list of messages")
    tags = spec.tags
    side = {tags["user_tag"]: "user", tags["observation_tag"]: "user",
            tags["assistant_tag"]: "assistant", tags["function_tag"]: "assistant"}
    system = _text(_column(record, spec, "system", index, required=False), spec, "the system prompt", index)
    if isinstance(messages[0], dict) and messages[0].get(tags["role_tag"]) == tags["system_tag"]:
        system = _text(messages[0].get(tags["content_tag"]), spec, "the system message", index)
        messages = messages[1:]  # a leading system message overrides the system column
    turns = []
    for k, message in enumerate(messages):
        role, content = _message(message, spec, index, f"message {k}")
        want = "user" if k % 2 == 0 else "assistant"
        if side.get(role) != want:
            allowed = [t for t, s in side.items() if s == want]
            raise ValueError(
                f"{spec.where(index)}: message {k} has {tags['role_tag']}={role!r}, expected one of "
                f"{', '.join(map(repr, allowed))} (turns alternate user, assistant, starting with the user)"
            )
        turns.append((want, content))
    return Conversation(turns, system)


def _message(message: Any, spec: DatasetSpec, index: int, what: str) -> tuple[Any, str]:
    """(role, content) of a sharegpt message; `what` names it in errors ("message 3")."""
    role_tag, content_tag = spec.tags["role_tag"], spec.tags["content_tag"]
    if not isinstance(message, dict) or role_tag not in message or content_tag not in message:
        raise ValueError(
            f"{spec.where(index)}: {what} must be an object with keys {role_tag!r} and {content_tag!r} "
            f"(set tags.role_tag / tags.content_tag in {INFO_FILE} if yours differ)"
        )
    return message[role_tag], _text(message[content_tag], spec, f"{what}'s content", index)


def pairwise_record(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> tuple[Conversation, str, str]:
    """A ranking record (stages rm, dpo): its conversation up to the answer, and the chosen and rejected answers.

    >>> from pathlib import Path
    >>> from hp.train.data.dataset_info import ALPACA_COLUMNS
    >>> columns = {**ALPACA_COLUMNS, "chosen": "good", "rejected": "bad"}
    >>> spec = DatasetSpec("d", Path("d.json"), columns=columns, ranking=True)
    >>> pairwise_record({"instruction": "1+1", "good": "2", "bad": "3"}, spec)
    (Conversation(turns=[('user', '1+1')], system=''), '2', '3')
    """
    if spec.formatting == "alpaca":
        conv = _alpaca_prompt(record, spec, index)
        chosen, rejected = (_answer_text(record, spec, side, index) for side in ("chosen", "rejected"))
    else:
        conv = sharegpt_conversation(record, spec, index)
        chosen, rejected = (_answer_message(record, spec, side, index) for side in ("chosen", "rejected"))
    return conv, chosen, rejected


def _answer_text(record: Mapping[str, Any], spec: DatasetSpec, side: str, index: int) -> str:
    value = _column(record, spec, side, index, required=True)
    if not isinstance(value, str):
        raise ValueError(f"{spec.where(index)}: column {spec.columns[side]!r} (the {side} answer) must be a string, "
                         f"got {type(value).__name__}")
    return value


def _answer_message(record: Mapping[str, Any], spec: DatasetSpec, side: str, index: int) -> str:
    """The content of a sharegpt ranking record's chosen or rejected message, which must be an answer's."""
    what = f"the {side} message (column {spec.columns[side]!r})"
    role, content = _message(_column(record, spec, side, index, required=True), spec, index, what)
    answers = (spec.tags["assistant_tag"], spec.tags["function_tag"])
    if role not in answers:
        raise ValueError(f"{spec.where(index)}: {what} has {spec.tags['role_tag']}={role!r}, expected one of "
                         f"{', '.join(map(repr, answers))} (an answer to the conversation's last user turn)")
    return content


def feedback_record(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> tuple[Conversation, bool]:
    """A kto record: its conversation (the judged answer last) and its kto_tag (True: desirable).

    >>> from pathlib import Path
    >>> from hp.train.data.dataset_info import ALPACA_COLUMNS
    >>> spec = DatasetSpec("d", Path("d.json"), columns={**ALPACA_COLUMNS, "kto_tag": "label"})
    >>> feedback_record({"instruction": "1+1", "output": "3", "label": False}, spec)
    (Conversation(turns=[('user', '1+1'), ('assistant', '3')], system=''), False)
    """
    read = alpaca_conversation if spec.formatting == "alpaca" else sharegpt_conversation
    conv = read(record, spec, index)
    tag = _column(record, spec, "kto_tag", index, required=True)
    if not isinstance(tag, bool):
        raise ValueError(f"{spec.where(index)}: column {spec.columns['kto_tag']!r} (the kto_tag) must be true or "
                         f"false, got {tag!r}")
    return conv, tag


def pt_text(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> str:
    """The document a pretraining record holds (see the module docstring for which column).

    >>> from pathlib import Path
    >>> pt_text({"text": "once upon a time"}, DatasetSpec("d", Path("d.json")))
    'once upon a time'
    """
    if spec.formatting != "alpaca":
        raise ValueError(f"{spec.where()}: stage pt reads plain text; the sharegpt formatting is for sft")
    if spec.columns["prompt"] not in record:
        if "text" in record:
            return _text(record["text"], spec, "'text'", index)
        raise ValueError(
            f"{spec.where(index)}: no column 'text' nor {spec.columns['prompt']!r} (the prompt); "
            f"the record has {', '.join(map(repr, record))}"
        )
    parts = [_column(record, spec, role, index, required=False) for role in ("prompt", "query", "response")]
    return "\n".join(_text(p, spec, "a text column", index) for p in parts if p)


def record_images(record: Mapping[str, Any], spec: DatasetSpec, index: int = 0) -> list[str]:
    """The paths of the images a record names in its images column (none when it has no such column or value).

    >>> from pathlib import Path
    >>> from hp.train.data.dataset_info import SHAREGPT_COLUMNS
    >>> spec = DatasetSpec("d", Path("data/d.json"), "sharegpt", {**SHAREGPT_COLUMNS, "images": "images"})
    >>> record_images({"images": ["a.png", "b.png"]}, spec)
    ['data/a.png', 'data/b.png']
    """
    value = _column(record, spec, "images", index, required=False)
    names = [value] if isinstance(value, str) else value or []
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise ValueError(f"{spec.where(index)}: {spec.columns['images']!r} must be a list of image file paths "
                         f"(relative to dataset_dir), got {value!r}")
    return [spec.image_path(name) for name in names]
