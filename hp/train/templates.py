"""Chat templates: how a conversation becomes text, by name (torch-free, so the config can list them).

The config validates `template` against these names before any worker
starts; the data layer renders conversations with them. One table serves both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Template:
    """How a conversation becomes text: `{content}` is replaced by each turn's text.

    `separator` goes before every user turn but the first (eos, which ends
    each assistant turn, is a token and not text). Everything but the
    assistant's content and the eos after it is masked out of the loss.

    >>> TEMPLATES["default"].user.format(content="hi")
    'Human: hi\\nAssistant: '
    """

    name: str
    system: str
    user: str
    assistant: str
    separator: str = ""


TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        Template("default", system="System: {content}\n", user="Human: {content}\nAssistant: ",
                 assistant="{content}", separator="\n"),
        Template("empty", system="{content}", user="{content}", assistant="{content}"),
        Template("alpaca", system="{content}\n\n", user="### Instruction:\n{content}\n\n### Response:\n",
                 assistant="{content}", separator="\n\n"),
    )
}
