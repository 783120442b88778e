"""A tokenizer's own Jinja `chat_template` read back as a `Template`, for configs that leave `template` unset.

LlamaFactory does this, so a config without `template` must mean the same
here: the chat template is rendered for a few probe conversations whose
texts are the `{{content}}` placeholder, and the slots are cut out of the
renderings. What the tokenizer puts before any text (its bos, when
`encode("")` adds one) becomes the prefix; the system slot is a lone system
message; the user slot is a user message with the generation prompt; the
assistant slot is what a reply adds after it. A system prompt that the
template inserts when the conversation has none is found by comparing the
user slot with and without an empty system message, and becomes the
default system prompt. An assistant slot that spells `<think>` marks a
reasoning template: the tags are taken out of the slot and each answer
without a thought gets an empty one, as LlamaFactory does.

Only what the probes show is captured: a template whose output depends on
more (the turn index, tools, a date) is read as its first turn says.
"""

from __future__ import annotations

from typing import Any

from hp.train.config.templates import CONTENT, Template

PARSED = "chat_template"  # the name a parsed template carries in messages
_THOUGHT = ("<think>\n", "\n</think>\n\n")  # LlamaFactory's thought words for parsed reasoning templates


def parse_chat_template(hf: Any) -> Template:
    """The template that `hf` (a transformers tokenizer with a `chat_template`) renders.

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> hf = ByteTokenizer().as_hf()
    >>> hf.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\\n{% endfor %}"
    ...                     "{% if add_generation_prompt %}<assistant>{% endif %}")
    >>> parse_chat_template(hf).user
    ('<user>{{content}}\\n<assistant>',)
    """
    try:
        return _parse(hf)
    except Exception as e:  # noqa: BLE001 - a Jinja error, a template refusing a probe (no system role, ...)
        raise ValueError(
            f"template is unset and the tokenizer's chat_template cannot be read as a template "
            f"({type(e).__name__}: {e}); set `template` to one of hp train's templates"
        ) from None


def _parse(hf: Any) -> Template:
    prefix = hf.decode(hf.encode(""))

    def render(messages: list[dict[str, str]], generation: bool) -> str:
        text = hf.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
        return text[len(prefix):]

    system = render([_turn("system", CONTENT)], False)
    user_after_empty_system = render([_turn("system", ""), _turn("user", CONTENT)], True)
    user = render([_turn("user", CONTENT)], True)
    assistant = render([_turn("user", CONTENT), _turn("assistant", CONTENT)], False)[len(user):]
    thinking = "<think>" in assistant
    assistant = assistant.replace("<think>", "").replace("</think>", "").lstrip("\n")
    default_system = ""
    if len(user) > len(user_after_empty_system):  # the template adds a system prompt of its own
        default_system = _left_over(user_after_empty_system, user)
        user = user[len(system.replace(CONTENT, default_system, 1)):]
    return Template(
        PARSED, user=(user,), assistant=(assistant,), system=(system,), prefix=(prefix,) if prefix else (),
        default_system=default_system, thought=_THOUGHT if thinking else None,
    )


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _left_over(short: str, long: str) -> str:
    """The characters of `long` that a left-to-right match of all of `short` into it skips.

    Once `short` is used up the rest of `long` is not counted: the default
    system prompt sits before the user's text, which both renderings share.

    >>> _left_over("<s><u>X", "<s>SYS<u>X</u>")
    'SYS'
    """
    skipped, i = [], 0
    for ch in long:
        if i == len(short):
            break
        if ch == short[i]:
            i += 1
        else:
            skipped.append(ch)
    return "".join(skipped)
