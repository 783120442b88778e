"""Conversations to token ids and labels with a chat template, as LlamaFactory's supervised (sft) stage does.

Each turn is rendered with its slot (`hp.train.config.templates`) and each text
part of it tokenized on its own, without special tokens added: the prefix
and the system prompt (the record's, else the template's default) lead the
first user turn. A conversation becomes (prompt, answer) pairs; every
prompt is masked (-100) and every answer supervised, history included.
There is no bos but the template's: `default`, `alpaca` and `empty` start
with the first text, `llama3`, `mistral`, `gemma` with the tokenizer's bos.

LlamaFactory's data arguments that change this are honoured as it honours
them: `default_system`, `enable_thinking` and `preserve_thinking` make a
changed copy of the template (`configure`); `train_on_prompt` supervises
the prompts too, and `mask_history` only the last answer, its turns being
given room last turn first (`encode_conversation`). What LlamaFactory
refuses is refused (`check_supervision`): `train_on_prompt` with an
`efficient_eos` template, or together with `mask_history`.

`cutoff_len` is shared out as LlamaFactory's `infer_seqlen` does
(`fit_lengths`): turn by turn (the last first under `mask_history`), a
short answer stays whole and the prompt is cut at its right; when both are
long each keeps a share in proportion to its length. Turns that find no
room left are dropped, and an `efficient_eos` template keeps one token for
its final eos.

Images are given as the token ids each one takes (`images`: a run per
image, in the order of the `<image>` placeholders in the turns): each
placeholder of a turn's text is replaced by its run, the texts around it
tokenized on their own, which gives the ids LlamaFactory's Qwen2-VL plugin
gets by writing the vision tokens into the text (an HF tokenizer splits its
special tokens out first). The cut of `cutoff_len` does not know images:
the data layer refuses a conversation whose images it would cut.

`template` unset (None) means, as in LlamaFactory, the tokenizer's own
`chat_template` read back by `hp.train.data.chat_template`, or `empty` when the
tokenizer has none (the byte tokenizer of `hp/tiny-llama` has none). A
template spelled with special tokens needs each of them to be one token of
the tokenizer: `check_template` refuses, naming them, where LlamaFactory
would add them to the vocabulary and resize the embeddings.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hp.train.config.templates import (
    BOS, EOS, IMAGE_PLACEHOLDER, TEMPLATES, VISION_TEMPLATES, Part, Special, Template, fill, missing_tokens,
)
from hp.train.data.chat_template import parse_chat_template

if TYPE_CHECKING:
    from hp.train.data.tokenizer import Tokenizer

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Conversation:
    """A system prompt and turns ("user" or "assistant", text), alternating from a user turn.

    >>> Conversation([("user", "2+2?"), ("assistant", "4")]).turns[1]
    ('assistant', '4')
    """

    turns: list[tuple[str, str]]
    system: str = ""


def get_template(template: str | Template | None, tokenizer: Tokenizer | None = None) -> Template:
    """The template named `template`; None: the tokenizer's chat_template, else `empty` (a Template passes through).

    >>> get_template("alpaca").user
    ('### Instruction:\\n{{content}}\\n\\n### Response:\\n',)
    >>> get_template(None).name  # no tokenizer, or one without a chat_template
    'empty'
    """
    if isinstance(template, Template):
        return template
    if template is None:
        hf = getattr(tokenizer, "hf", None)  # only a transformers tokenizer carries a chat_template
        if isinstance(getattr(hf, "chat_template", None), str):
            return parse_chat_template(hf)
        return TEMPLATES["empty"]
    known = {**TEMPLATES, **VISION_TEMPLATES}
    if template not in known:
        raise ValueError(f"template {template!r} is unknown; known: {', '.join(known)}")
    return known[template]


def check_template(template: Template, tokenizer: Tokenizer, stage: str = "sft") -> None:
    """Refuse a template whose special tokens the tokenizer lacks (each must be one token).

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> check_template(TEMPLATES["qwen"], ByteTokenizer())
    Traceback (most recent call last):
    ...
    ValueError: template 'qwen' needs '<|im_start|>', '<|im_end|>' as special tokens, which the tokenizer (ByteTokenizer(vocab_size=259)) lacks (each must be one token); LlamaFactory would add them to the vocabulary and resize the embeddings, which hp train does not do: use a model whose tokenizer has them, or a template without special tokens (default, empty, alpaca, llama2, mistral, vicuna, falcon, olmo, deepseek, ministral, seed_oss)
    """
    missing = missing_tokens(template, lambda token: single_id(token, tokenizer), stage)
    if not missing:
        return
    text_only = [name for name, t in TEMPLATES.items() if not t.required_tokens()]
    kind, them = ("a special token", "it") if len(missing) == 1 else ("special tokens", "them")
    raise ValueError(
        f"template {template.name!r} needs {', '.join(map(repr, missing))} as {kind}, which the tokenizer "
        f"({tokenizer!r}) lacks (each must be one token); LlamaFactory would add {them} to the vocabulary and "
        f"resize the embeddings, which hp train does not do: use a model whose tokenizer has {them}, or a template "
        f"without special tokens ({', '.join(text_only)})"
    )


def template_for(
    template: str | Template | None,
    tokenizer: Tokenizer,
    stage: str = "sft",
    *,
    default_system: str | None = None,
    enable_thinking: bool | None = True,
    preserve_thinking: bool = False,
) -> Template:
    """The template a `stage` dataset is encoded with (`get_template`, then `configure`), checked against the tokenizer.

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> template_for(None, ByteTokenizer()).name
    'empty'
    """
    if stage == "pt" and template is None:
        # pt renders no conversation; a template read from a chat_template never replaces eos, so `empty`
        # ends documents alike without reading a chat_template that pt does not need.
        tmpl = TEMPLATES["empty"]
    else:
        tmpl = get_template(template, tokenizer)
    tmpl = configure(tmpl, default_system=default_system, enable_thinking=enable_thinking,
                     preserve_thinking=preserve_thinking)
    check_template(tmpl, tokenizer, stage)
    return tmpl


def configure(
    template: Template,
    *,
    default_system: str | None = None,
    enable_thinking: bool | None = True,
    preserve_thinking: bool = False,
) -> Template:
    """`template` as LlamaFactory's data arguments set it (its `get_template_and_fix_tokenizer`): a changed copy.

    `default_system`, unless None, replaces the template's default system
    prompt ("" leaves none). `enable_thinking` and `preserve_thinking` are
    set on reasoning templates (those with a `thought`) only: the others
    ignore them, as LlamaFactory's do.

    >>> configure(TEMPLATES["alpaca"], default_system="Be brief.").default_system
    'Be brief.'
    >>> configure(TEMPLATES["qwen3"], enable_thinking=False).enable_thinking
    False
    >>> configure(TEMPLATES["qwen"], enable_thinking=False) is TEMPLATES["qwen"]
    True
    """
    if not (default_system is None or isinstance(default_system, str)):
        raise ValueError(f"default_system = {default_system!r}: expected a string, or None for the template's own")
    for key, value, allowed in (("enable_thinking", enable_thinking, (True, False, None)),
                                ("preserve_thinking", preserve_thinking, (True, False))):
        if not any(value is a for a in allowed):
            raise ValueError(f"{key} = {value!r}: expected {' or '.join(map(str, allowed))}")
    wanted: dict[str, object] = {"default_system": default_system} if default_system is not None else {}
    if template.thought is not None:
        wanted.update(enable_thinking=enable_thinking, preserve_thinking=preserve_thinking)
    changes = {key: value for key, value in wanted.items() if getattr(template, key) != value}
    return dataclasses.replace(template, **changes) if changes else template


def check_supervision(template: Template, *, train_on_prompt: bool = False, mask_history: bool = False) -> None:
    """Refuse what LlamaFactory refuses: `train_on_prompt` with an `efficient_eos` template, or with `mask_history`.

    >>> check_supervision(TEMPLATES["falcon"], train_on_prompt=True)
    Traceback (most recent call last):
    ...
    ValueError: train_on_prompt = true with template 'falcon': an efficient_eos template supervises each answer's eos at the first token of the next prompt, which a supervised prompt would overwrite (LlamaFactory refuses this too: "Current template does not support `train_on_prompt`"); expected train_on_prompt: false, or a template without efficient_eos (not gemma2, falcon, glm4, glm4_moe, glm4_7, glmz1, gpt_oss)
    """
    for key, value in (("train_on_prompt", train_on_prompt), ("mask_history", mask_history)):
        if not isinstance(value, bool):
            raise ValueError(f"{key} = {value!r}: expected true or false")
    if train_on_prompt and mask_history:
        raise ValueError("train_on_prompt = true with mask_history = true: train_on_prompt supervises every prompt and "
                         "mask_history nothing but the last answer (LlamaFactory refuses them together: "
                         "\"`mask_history` is incompatible with `train_on_prompt`\"); expected at most one of them")
    if train_on_prompt and template.efficient_eos:
        efficient = [name for name, t in TEMPLATES.items() if t.efficient_eos]
        raise ValueError(
            f"train_on_prompt = true with template {template.name!r}: an efficient_eos template supervises each "
            "answer's eos at the first token of the next prompt, which a supervised prompt would overwrite "
            "(LlamaFactory refuses this too: \"Current template does not support `train_on_prompt`\"); expected "
            f"train_on_prompt: false, or a template without efficient_eos (not {', '.join(efficient)})"
        )


def eos_id(template: Template, tokenizer: Tokenizer) -> int:
    """The id ending the template's turns: its replacing stop word's (`replace_eos`), else the tokenizer's eos.

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> eos_id(TEMPLATES["default"], ByteTokenizer())
    258
    """
    return _token_id(template.eos_token, tokenizer) if template.eos_token else tokenizer.eos_token_id


def document_end_id(template: Template, tokenizer: Tokenizer) -> int:
    """The id ending each pt document: llama3's <|end_of_text|>, else the template's eos (as LlamaFactory's pt).

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> document_end_id(TEMPLATES["empty"], ByteTokenizer())
    258
    """
    return _token_id(template.document_end, tokenizer) if template.document_end else eos_id(template, tokenizer)


def single_id(token: str, tokenizer: Tokenizer) -> int | None:
    """The id `tokenizer` has for `token` as one token of its own, else None (split, or read as unknown).

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> single_id("a", ByteTokenizer()), single_id("<|im_end|>", ByteTokenizer())
    (97, None)
    """
    ids = tokenizer.encode(token)
    # A word-level vocabulary reads a token it lacks as its unknown token: one id, but not the token's own.
    unknown = getattr(getattr(tokenizer, "hf", None), "unk_token_id", None)
    return ids[0] if len(ids) == 1 and ids[0] != unknown else None


def _token_id(token: str, tokenizer: Tokenizer) -> int:
    found = single_id(token, tokenizer)
    if found is None:  # check_template names these before any worker starts; this guards direct callers
        raise ValueError(f"the tokenizer ({tokenizer!r}) has no single token {token!r}")
    return found


def _ids(parts: list[Part], template: Template, tokenizer: Tokenizer,
         images: Iterator[Sequence[int]] | None = None) -> list[int]:
    """Token ids of a turn's parts, each text tokenized on its own (as LlamaFactory, so its ids are ours);
    with `images`, each `<image>` in a text is the next image's ids."""
    ids: list[int] = []
    for part in parts:
        if isinstance(part, str) and images is not None and IMAGE_PLACEHOLDER in part:
            ids += _with_images(part, tokenizer, images)
        elif isinstance(part, str):
            ids += tokenizer.encode(part) if part else []
        elif part == BOS:
            ids += [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        elif part == EOS:
            ids.append(eos_id(template, tokenizer))
        elif isinstance(part, Special) and part.role == "token":
            ids.append(_token_id(part.name, tokenizer))
        else:
            raise ValueError(f"template {template.name!r}: a slot part must be text or a Special, got {part!r}")
    return ids


def _with_images(text: str, tokenizer: Tokenizer, images: Iterator[Sequence[int]]) -> list[int]:
    """`text` tokenized with each `<image>` replaced by the next image's ids.

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> _with_images("a<image>b", ByteTokenizer(), iter([[300, 301]]))
    [97, 300, 301, 98]
    """
    first, *rest = text.split(IMAGE_PLACEHOLDER)
    ids = tokenizer.encode(first) if first else []
    for piece in rest:
        run = next(images, None)
        if run is None:  # the data layer counts placeholders and images first; this guards direct callers
            raise ValueError(f"a turn has more {IMAGE_PLACEHOLDER} placeholders than images were given")
        ids += [*run, *(tokenizer.encode(piece) if piece else [])]
    return ids


def encode_pairs(
    conv: Conversation, tokenizer: Tokenizer, template: Template, *, drop_history_thoughts: bool = False,
    images: Sequence[Sequence[int]] = (),
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) for each user turn and the answer after it (an empty answer when none).

    A reasoning template (one with a `thought`) treats thoughts as
    LlamaFactory's ReasoningTemplate does: `enable_thinking` False removes
    them from every answer; `drop_history_thoughts` (mask_history without
    preserve_thinking) removes them from all answers but the last, and then
    only the last may get an empty thought. An answer left without a thought
    gets the empty one at its head, or at the end of its prompt when
    `enable_thinking` is not True. `images` are the ids of each image, in
    order, for the `<image>` placeholders of the turns (not of the system
    prompt); none given, `<image>` is text.

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> encode_pairs(Conversation([("user", "a"), ("assistant", "b")]), ByteTokenizer(), TEMPLATES["empty"])
    [([97], [98])]
    """
    system = conv.system or template.default_system
    turns = list(conv.turns) + ([("assistant", "")] if len(conv.turns) % 2 else [])
    thought = template.thought
    if thought is not None:
        for i, (role, content) in enumerate(turns):
            earlier = i < len(turns) - 1
            if role == "assistant" and (template.enable_thinking is False or (drop_history_thoughts and earlier)):
                turns[i] = (role, _without_thought(content, thought))
    runs = iter(images) if images else None
    encoded = []
    for i, (role, content) in enumerate(turns):
        parts: list[Part] = []
        if i == 0:
            parts += template.prefix
            if system and not template.system_in_user:
                parts += fill(template.system, system)
            elif system:  # Llama-2 style: the system text opens the first user message
                content = str(fill(template.system, system)[0]) + content
        slot = template.user if role == "user" else template.assistant
        encoded.append(_ids(parts, template, tokenizer) + _ids(fill(slot, content), template, tokenizer, runs))
    pairs = [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]
    if thought is None:
        return pairs
    empty = tokenizer.encode(thought[0] + thought[1] if template.empty_thought is None else template.empty_thought)
    for k in [len(pairs) - 1] if drop_history_thoughts else range(len(pairs)):
        if not _has_thought(turns[2 * k + 1][1], thought):
            prompt, answer = pairs[k]
            # enable_thinking True: the empty thought is learnt; False or None: it is given, in the prompt
            pairs[k] = (prompt, empty + answer) if template.enable_thinking else (prompt + empty, answer)
    return pairs


def _has_thought(content: str, thought: tuple[str, str]) -> bool:
    return thought[0].strip() in content or thought[1].strip() in content


def _without_thought(content: str, thought: tuple[str, str]) -> str:
    """`content` without its thoughts (each opening and closing pair, whole), as LlamaFactory's `remove_thought`.

    >>> _without_thought("<think>\\nhm\\n</think>\\n\\n4", ("<think>\\n", "\\n</think>\\n\\n"))
    '4'
    """
    pattern = re.compile(f"{re.escape(thought[0])}(.*?){re.escape(thought[1])}", re.DOTALL)
    return pattern.sub("", content).lstrip("\n")


def fit_lengths(prompt_len: int, answer_len: int, room: int) -> tuple[int, int]:
    """(prompt, answer) lengths kept within `room` tokens, shared as LlamaFactory's `infer_seqlen`.

    A short answer (under half the room) stays whole; else a short prompt
    does; else each keeps a share in proportion to its length.

    >>> fit_lengths(100, 4, 20), fit_lengths(4, 100, 20), fit_lengths(30, 10, 20)
    ((16, 4), (4, 16), (15, 5))
    """
    if answer_len * 2 < room:
        answer_room = room
    elif prompt_len * 2 < room:
        answer_room = room - prompt_len
    else:
        answer_room = int(room * (answer_len / (prompt_len + answer_len)))
    answer = min(answer_room, answer_len)
    return min(max(room - answer, 0), prompt_len), answer


def encode_conversation(
    conv: Conversation,
    tokenizer: Tokenizer,
    template: Template,
    cutoff_len: int | None = None,
    *,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    images: Sequence[Sequence[int]] = (),
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a conversation, at most `cutoff_len` long: labels are -100 but on the answers.

    `train_on_prompt` supervises the prompts as well; `mask_history`
    supervises the last answer only and shares `cutoff_len` out from the
    last turn back, so that a cut drops the oldest turns (LlamaFactory's
    supervised processor; its efficient_eos label then follows the reversed
    order too, as there). `images` are the ids of each image (see `encode_pairs`).

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> encode_conversation(Conversation([("user", "a"), ("assistant", "b")]), ByteTokenizer(), TEMPLATES["default"])
    ([72, 117, 109, 97, 110, 58, 32, 97, 258, 10, 65, 115, 115, 105, 115, 116, 97, 110, 116, 58, 98, 258, 10], [-100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, 98, 258, 10])
    """
    check_supervision(template, train_on_prompt=train_on_prompt, mask_history=mask_history)
    pairs = encode_pairs(conv, tokenizer, template,
                         drop_history_thoughts=mask_history and not template.preserve_thinking, images=images)
    limit = cutoff_len if cutoff_len is not None else sum(len(p) + len(a) for p, a in pairs) + 1
    eos = eos_id(template, tokenizer)
    used = 1 if template.efficient_eos else 0  # the final eos is kept room for
    if mask_history:
        pairs = pairs[::-1]  # the last turns first: they are given the room
    turns: list[tuple[list[int], list[int]]] = []
    for k, (prompt, answer) in enumerate(pairs):
        if used >= limit:
            break
        p, a = fit_lengths(len(prompt), len(answer), limit - used)
        used += p + a
        prompt, answer = prompt[:p], answer[:a]
        prompt_labels = list(prompt) if train_on_prompt else [IGNORE_INDEX] * p
        if template.efficient_eos and k and p:
            prompt_labels[0] = eos  # eos is not in the input: the previous answer learns to end here
        answer_labels = [IGNORE_INDEX] * a if mask_history and k else answer
        turns.append((prompt + answer, prompt_labels + answer_labels))
    if mask_history:
        turns.reverse()
    ids = [i for turn_ids, _ in turns for i in turn_ids]
    labels = [label for _, turn_labels in turns for label in turn_labels]
    if template.efficient_eos:
        ids.append(eos)
        labels.append(eos)
    return ids, labels


def encode_prompt(
    prompt: str,
    tokenizer: Tokenizer,
    template: str | Template | None = None,
    system: str = "",
    *,
    default_system: str | None = None,
    enable_thinking: bool | None = True,
) -> list[int]:
    """The ids to generate from: one user turn rendered as in training, ending where the answer starts.

    `default_system` replaces the template's (for a prompt without `system`),
    and with `enable_thinking` False (or None) a reasoning template's prompt
    ends with the empty thought, as LlamaFactory's chat does.

    >>> from hp.train.data.byte_tokenizer import ByteTokenizer
    >>> tok = ByteTokenizer()
    >>> tok.decode(encode_prompt("reverse\\nabc", tok, "alpaca", system="Be brief.\\n\\n"))
    'Be brief.\\n\\n### Instruction:\\nreverse\\nabc\\n\\n### Response:\\n'
    """
    tmpl = template_for(template, tokenizer, default_system=default_system, enable_thinking=enable_thinking)
    ((ids, _),) = encode_pairs(Conversation([("user", prompt)], system), tokenizer, tmpl)
    return ids
