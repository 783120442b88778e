"""Chat templates: LlamaFactory's, by name, as small frozen values (torch-free, so the config can list them).

A template says how each turn of a conversation becomes tokens. Each of its
slots (prefix, system, user, assistant) is a tuple of parts: a text, in
which `{{content}}` stands for the turn's text, or a `Special` placed by id
(the tokenizer's bos or eos, or a token named in the vocabulary). Each text
part is tokenized on its own, as LlamaFactory does, so the ids are its ids;
`hp.train.data.encoding` does that and builds the labels.

The names and what they render are LlamaFactory's (`default`, `empty` and
`alpaca` included: `default` puts eos after the user's and the system's
text too, and `empty` has no eos at all). Special tokens that a template
spells in its text (`<|im_start|>`, ...) are listed in `special_tokens`:
the tokenizer must hold each as one token, or `missing_tokens` names it
(LlamaFactory would add it to the vocabulary and resize the embeddings;
hp train refuses instead of training on different ids). Stop words other
than the one that replaces eos only stop generation, so they are not
required. The config validates `template` against `TEMPLATE_NAMES` before any
worker starts, and the data layer encodes with the same values.

A template for a vision-language model (`VISION_TEMPLATES`: LlamaFactory's
`qwen2_vl`) is a text template and the name of the plugin that places images
(`mm_plugin`, as LlamaFactory's `get_mm_plugin`): each `<image>` placeholder
(`IMAGE_PLACEHOLDER`) of a turn becomes the image's tokens
(`hp.train.data.vision`). A template without a plugin reads `<image>` as text, and
the data layer refuses records with images for it, as LlamaFactory's base
plugin does. `TEMPLATES` holds the text templates, each checked against
LlamaFactory's own encoding (`tests/test_templates.py`).

Of LlamaFactory's templates for the families hp trains, these are left out:
- `gemma3`, `gemma4`, `mistral_small`, `ministral3`: they carry an image plugin (gemma3, gemma4, pixtral) that
  hp lacks, which LlamaFactory runs on text records too (it needs the model's processor); for Gemma 3 text,
  `gemma` renders the same.
- `glm4v`, `glm4_5v`, `glm_ocr`, `granite3_vision`, `intern_vl`, `intern_s1`, `ernie_vl`, `mimo_vl`,
  `youtu_vl`: vision templates, with plugins hp lacks.
- SmolLM3, EXAONE 4 and InternLM3 have no template of their own there (InternLM3 takes `intern2`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

CONTENT = "{{content}}"  # LlamaFactory's placeholder; replaced once, so braces in the text itself stay as they are
IMAGE_PLACEHOLDER = "<image>"  # where an image goes in a turn's text (LlamaFactory's IMAGE_PLACEHOLDER)


@dataclass(frozen=True)
class Special:
    """A token placed by id: the tokenizer's `bos` or `eos` (role), or the token named `name` (role `token`).

    >>> Special("token", "<|im_end|>").name
    '<|im_end|>'
    """

    role: str  # "bos", "eos" or "token"
    name: str = ""


BOS = Special("bos")  # dropped when the tokenizer has no bos, as in LlamaFactory
EOS = Special("eos")  # the template's eos: see `Template.eos_token`

Part = str | Special
Slot = tuple[Part, ...]


@dataclass(frozen=True)
class Template:
    """How a conversation becomes token parts (see the module docstring).

    The first user turn is preceded by `prefix` and, when there is a system
    prompt (the record's, else `default_system`), by the `system` slot; with
    `system_in_user` the system slot's text is put in front of the first
    user's text instead (LlamaFactory's Llama-2 style). The user slot ends
    where the answer starts. A `thought` pair marks a reasoning template:
    an answer that spells neither tag gets an empty thought (the two
    joined, or `empty_thought`) at its head, supervised, as LlamaFactory
    does with `enable_thinking: true`; `enable_thinking` False removes every thought
    and puts the empty one at the end of the prompt instead, unsupervised,
    and None keeps the thoughts given but puts the empty one in the prompt
    too (LlamaFactory's ReasoningTemplate). `preserve_thinking` keeps the
    thoughts of earlier answers under `mask_history`, which otherwise drops
    them. These two mean nothing to a template without `thought`, as in
    LlamaFactory; `hp.train.data.encoding.configure` sets them and
    `default_system` from a config. `efficient_eos` templates leave eos out of the
    assistant slot and supervise it once, at the end, and after each answer
    in the label of the next prompt's first token. With `replace_eos` the
    first stop word is the eos (of the eos slots and of pt documents).

    >>> TEMPLATES["alpaca"].user
    ('### Instruction:\\n{{content}}\\n\\n### Response:\\n',)
    >>> TEMPLATES["qwen"].eos_token
    '<|im_end|>'
    """

    name: str
    user: Slot = (CONTENT,)
    assistant: Slot = (CONTENT, EOS)
    system: Slot = (CONTENT,)
    prefix: Slot = ()
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    replace_eos: bool = False
    efficient_eos: bool = False
    system_in_user: bool = False
    thought: tuple[str, str] | None = None
    special_tokens: tuple[str, ...] = ()  # spelled in the slots' text: each must be one token of the tokenizer
    document_end: str | None = None  # what ends a pt document when not the eos (llama3's <|end_of_text|>)
    enable_thinking: bool | None = True  # reasoning templates: where the empty thought goes (see above)
    preserve_thinking: bool = False  # reasoning templates: earlier answers keep their thoughts under mask_history
    mm_plugin: str | None = None  # what places images: "qwen2_vl" (vision_start, image tokens, vision_end), or none
    # a reasoning template's empty thought where it is not the two tags joined (GLM-4.7 writes its closing tag alone)
    empty_thought: str | None = None

    def __post_init__(self) -> None:
        # A slot without the placeholder would drop the turn's text; LlamaFactory refuses those as well.
        for role in ("user", "assistant", "system"):
            if not any(isinstance(p, str) and CONTENT in p for p in getattr(self, role)):
                raise ValueError(f"template {self.name!r}: the {role} slot has no {CONTENT} for the turn's text")
        if self.system_in_user and not isinstance(self.system[0], str):
            raise ValueError(f"template {self.name!r}: system_in_user needs a system slot that starts with its text")
        if self.replace_eos and not self.stop_words:
            raise ValueError(f"template {self.name!r}: replace_eos needs a stop word to be the eos")

    @property
    def eos_token(self) -> str | None:
        """The token that replaces the tokenizer's eos, or None to keep the tokenizer's."""
        return self.stop_words[0] if self.replace_eos else None

    def required_tokens(self, stage: str = "sft") -> tuple[str, ...]:
        """Tokens the tokenizer must hold, one id each: for sft the spelled specials, the eos
        replacement and named tokens; for pt only what ends a document.

        >>> TEMPLATES["chatml"].required_tokens()
        ('<|im_start|>', '<|im_end|>')
        >>> TEMPLATES["llama3"].required_tokens("pt"), TEMPLATES["default"].required_tokens()
        (('<|end_of_text|>',), ())
        """
        if stage == "pt":
            end = self.document_end or self.eos_token
            return (end,) if end else ()
        named = [p.name for slot in (self.prefix, self.system, self.user, self.assistant) for p in slot
                 if isinstance(p, Special) and p.role == "token"]
        wanted = [*self.special_tokens, *([self.eos_token] if self.eos_token else []), *named]
        return tuple(dict.fromkeys(wanted))


def fill(slot: Slot, content: str) -> list[Part]:
    """The slot's parts with `{{content}}` replaced (first occurrence of each text part, as LlamaFactory).

    >>> fill(TEMPLATES["default"].user, "hi")
    ['Human: hi', Special(role='eos', name=''), '\\nAssistant:']
    """
    return [p.replace(CONTENT, content, 1) if isinstance(p, str) else p for p in slot]


def missing_tokens(template: Template, token_id: Callable[[str], int | None], stage: str = "sft") -> list[str]:
    """The tokens `template` needs for `stage` that have no id of their own (`token_id` gives None).

    >>> missing_tokens(TEMPLATES["chatml"], {"<|im_start|>": 7}.get)
    ['<|im_end|>']
    """
    return [token for token in template.required_tokens(stage) if token_id(token) is None]


_QWEN_USER = "<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"
_QWEN_SYSTEM = "<|im_start|>system\n{{content}}<|im_end|>\n"
_QWEN_ANSWER = "{{content}}<|im_end|>\n"
_IM = ("<|im_start|>", "<|im_end|>")
_LLAMA3_HEADERS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_GEMMA_TURN = "<start_of_turn>user\n{{content}}<end_of_turn>\n<start_of_turn>model\n"
_THINK = ("<think>\n", "\n</think>\n\n")  # LlamaFactory's thought words where a template names none
# Slots that a family's templates share (LlamaFactory writes each out in full)
_CHATML = dict(user=(_QWEN_USER,), assistant=(_QWEN_ANSWER,), system=(_QWEN_SYSTEM,), special_tokens=_IM)
_GLM4 = dict(user=("<|user|>\n{{content}}<|assistant|>",), assistant=("\n{{content}}",),
             system=("<|system|>\n{{content}}",), prefix=("[gMASK]<sop>",), stop_words=("<|user|>", "<|observation|>"),
             efficient_eos=True, special_tokens=("[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|system|>"))
_GRANITE = dict(user=("<|start_of_role|>user<|end_of_role|>{{content}}<|end_of_text|>\n"
                      "<|start_of_role|>assistant<|end_of_role|>",),
                assistant=("{{content}}<|end_of_text|>\n",),
                system=("<|start_of_role|>system<|end_of_role|>{{content}}<|end_of_text|>\n",),
                special_tokens=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"))
_DEEPSEEK3 = dict(user=("<｜User｜>{{content}}<｜Assistant｜>",), prefix=(BOS,),
                  special_tokens=("<｜User｜>", "<｜Assistant｜>"))

TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        Template("default", user=("Human: {{content}}", EOS, "\nAssistant:"), assistant=(CONTENT, EOS, "\n"),
                 system=("System: {{content}}", EOS, "\n")),
        Template("empty", assistant=(CONTENT,)),
        Template("alpaca", user=("### Instruction:\n{{content}}\n\n### Response:\n",),
                 assistant=(CONTENT, EOS, "\n\n"),
                 default_system=("Below is an instruction that describes a task. "
                                 "Write a response that appropriately completes the request.\n\n")),
        Template("chatml", user=(_QWEN_USER,), assistant=(_QWEN_ANSWER,), system=(_QWEN_SYSTEM,),
                 stop_words=_IM, replace_eos=True, special_tokens=_IM),
        Template("qwen", user=(_QWEN_USER,), assistant=(_QWEN_ANSWER,), system=(_QWEN_SYSTEM,),
                 default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
                 stop_words=("<|im_end|>",), replace_eos=True, special_tokens=_IM),
        Template("qwen3", user=(_QWEN_USER,), assistant=(_QWEN_ANSWER,), system=(_QWEN_SYSTEM,),
                 stop_words=("<|im_end|>",), replace_eos=True, special_tokens=_IM,
                 thought=("<think>\n", "\n</think>\n\n")),
        Template("qwen3_nothink", user=(_QWEN_USER,), assistant=(_QWEN_ANSWER,), system=(_QWEN_SYSTEM,),
                 stop_words=("<|im_end|>",), replace_eos=True, special_tokens=_IM),
        Template("llama3",
                 user=("<|start_header_id|>user<|end_header_id|>\n\n{{content}}<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\n",),
                 assistant=("{{content}}<|eot_id|>",),
                 system=("<|start_header_id|>system<|end_header_id|>\n\n{{content}}<|eot_id|>",),
                 prefix=(BOS,), stop_words=("<|eot_id|>", "<|eom_id|>"), replace_eos=True,
                 special_tokens=_LLAMA3_HEADERS, document_end="<|end_of_text|>"),
        Template("llama2", user=(BOS, "[INST] {{content}} [/INST]"), system=("<<SYS>>\n{{content}}\n<</SYS>>\n\n",),
                 system_in_user=True),
        Template("mistral", user=("[INST] {{content}}[/INST]",), assistant=(" {{content}}", EOS),
                 system=("{{content}}\n\n",), prefix=(BOS,), system_in_user=True),
        Template("gemma", user=(_GEMMA_TURN,), assistant=("{{content}}<end_of_turn>\n",), system=("{{content}}\n\n",),
                 prefix=(BOS,), stop_words=("<end_of_turn>",), replace_eos=True, system_in_user=True,
                 special_tokens=("<start_of_turn>", "<end_of_turn>")),
        Template("gemma2", user=(_GEMMA_TURN,), assistant=("{{content}}<end_of_turn>\n",), system=("{{content}}\n\n",),
                 prefix=(BOS,), stop_words=("<eos>", "<end_of_turn>"), efficient_eos=True, system_in_user=True,
                 special_tokens=("<start_of_turn>", "<end_of_turn>")),
        Template("phi", user=("<|user|>\n{{content}}<|end|>\n<|assistant|>\n",), assistant=("{{content}}<|end|>\n",),
                 system=("<|system|>\n{{content}}<|end|>\n",), stop_words=("<|end|>",), replace_eos=True,
                 special_tokens=("<|user|>", "<|end|>", "<|assistant|>", "<|system|>")),
        Template("vicuna", user=("USER: {{content}} ASSISTANT:",),
                 default_system=("A chat between a curious user and an artificial intelligence assistant. "
                                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")),
        Template("falcon", user=("User: {{content}}\nFalcon:",), assistant=("{{content}}\n",), efficient_eos=True),
        # OLMo, OLMo-2, OLMo-3: the turn tags are text to OLMo's tokenizers, and an eos opens the conversation
        Template("olmo", user=("<|user|>\n{{content}}<|assistant|>\n",), prefix=(EOS,)),
        Template("granite3", **_GRANITE),
        Template("granite4", **_GRANITE, stop_words=("<|end_of_text|>",),
                 default_system="You are Granite, developed by IBM. You are a helpful AI assistant."),
        Template("glm4", **_GLM4),
        Template("glm4_moe", **_GLM4, thought=_THINK),  # GLM-4.5
        Template("glm4_7", **_GLM4, thought=("<think>", "</think>"), empty_thought="</think>"),
        Template("glmz1", **_GLM4, thought=_THINK),
        Template("deepseek", user=("User: {{content}}\n\nAssistant:",), system=("{{content}}\n\n",), prefix=(BOS,)),
        Template("deepseek3", **_DEEPSEEK3),
        Template("deepseekr1", **_DEEPSEEK3, thought=_THINK),
        # gpt-oss: the harmony format's analysis channel is the thought, the final channel the answer
        Template("gpt_oss", user=("<|start|>user<|message|>{{content}}<|end|><|start|>assistant",),
                 assistant=(CONTENT,), system=("<|start|>system<|message|>{{content}}<|end|>",),
                 default_system="You are ChatGPT, a large language model trained by OpenAI.", efficient_eos=True,
                 thought=("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"),
                 special_tokens=("<|start|>", "<|message|>", "<|end|>", "<|channel|>")),
        Template("ministral", user=("[INST]{{content}}[/INST]",), system=("{{content}}\n\n",), prefix=(BOS,),
                 system_in_user=True),  # Mistral's tekken tokenizers, Llama-2 style; [INST] is text, as in `mistral`
        Template("cohere", user=("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{{content}}<|END_OF_TURN_TOKEN|>"
                                 "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",),
                 system=("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{{content}}<|END_OF_TURN_TOKEN|>",), prefix=(BOS,),
                 special_tokens=("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
                                 "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>")),
        Template("smollm", **_CHATML, stop_words=("<|im_end|>",)),
        Template("smollm2", **_CHATML, stop_words=("<|im_end|>",),
                 default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face."),
        Template("intern2", **_CHATML, prefix=(BOS,), stop_words=("<|im_end|>",), default_system=(  # InternLM2, 3
            "You are an AI assistant whose name is InternLM (书生·浦语).\n"
            "- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI Laboratory "
            "(上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n"
            "- InternLM (书生·浦语) can understand and communicate fluently in the language "
            "chosen by the user such as English and 中文.")),
        Template("exaone", user=("[|user|]{{content}}\n[|assistant|]",), assistant=(CONTENT, EOS, "\n"),
                 system=("[|system|]{{content}}[|endofturn|]\n",),
                 special_tokens=("[|user|]", "[|assistant|]", "[|system|]", "[|endofturn|]")),
        Template("falcon_h1", **_CHATML, prefix=(BOS,), stop_words=("<|im_end|>", "<|end_of_text|>")),
        # ERNIE-4.5: its thinking model, then its instruct ones
        Template("ernie", user=("<|im_start|>user\n{{content}}<|im_end|>\n\n<|im_start|>assistant\n",),
                 assistant=("{{content}}<|im_end|>\n\n",), system=("<|im_start|>system\n{{content}}<|im_end|>\n\n",),
                 default_system="<global_setting>\nthink_mode=True\n</global_setting>", stop_words=("<|im_end|>",),
                 special_tokens=_IM),
        Template("ernie_nothink", user=("User: {{content}}\nAssistant: ",), system=("{{content}}\n",),
                 assistant=("{{content}}<|end_of_sentence|>",), prefix=("<|begin_of_sentence|>",),
                 stop_words=("<|end_of_sentence|>",),
                 special_tokens=("<|begin_of_sentence|>", "<|end_of_sentence|>")),
        Template("minimax1", user=("<beginning_of_sentence>user name=user\n{{content}}<end_of_sentence>\n"
                                   "<beginning_of_sentence>ai name=assistant\n",),
                 assistant=("{{content}}<end_of_sentence>\n",),
                 system=("<beginning_of_sentence>system ai_setting=assistant\n{{content}}<end_of_sentence>\n",),
                 default_system="You are a helpful assistant.", stop_words=("<end_of_sentence>",),
                 special_tokens=("<beginning_of_sentence>", "<end_of_sentence>")),
        Template("minimax2", user=("]~b]user\n{{content}}[e~[\n]~b]ai\n",), assistant=("{{content}}[e~[\n",),
                 system=("]~!b[]~b]system\n{{content}}[e~[\n",), stop_words=("[e~[",), thought=_THINK,
                 default_system="You are a helpful assistant. Your name is MiniMax-M2.1 and is built by MiniMax.",
                 special_tokens=("]~!b[", "]~b]", "[e~[")),
        Template("mimo_v2", **_CHATML, default_system="You are MiMo, a helpful AI assistant engineered by Xiaomi.",
                 stop_words=("<|im_end|>",), replace_eos=True, thought=("<think>", "</think>")),
        # Seed-OSS: the tokenizer's bos and eos open and close each turn
        Template("seed_oss", user=(BOS, "user\n{{content}}", EOS, BOS, "assistant\n"),
                 system=(BOS, "system\n{{content}}", EOS), thought=("<seed:think>", "</seed:think>")),
        Template("hy3", user=("<｜hy_User｜>{{content}}<｜hy_Assistant｜>",), assistant=("{{content}}<｜hy_eos｜>",),
                 prefix=(BOS,), stop_words=("<｜hy_eos｜>",), replace_eos=True, thought=("<think>", "</think>"),
                 special_tokens=("<｜hy_User｜>", "<｜hy_Assistant｜>")),
        Template("youtu", user=("<|User|>{{content}}<|Assistant|>",), assistant=("{{content}}<|end_of_text|>",),
                 prefix=(BOS,), stop_words=("<|end_of_text|>",), replace_eos=True, thought=_THINK,
                 special_tokens=("<|User|>", "<|Assistant|>")),
        Template("phi4", user=("<|im_start|>user<|im_sep|>{{content}}<|im_end|><|im_start|>assistant<|im_sep|>",),
                 assistant=("{{content}}<|im_end|>",), system=("<|im_start|>system<|im_sep|>{{content}}<|im_end|>",),
                 stop_words=("<|im_end|>",), replace_eos=True,
                 special_tokens=("<|im_start|>", "<|im_sep|>", "<|im_end|>")),
        Template("phi4_mini", user=("<|user|>{{content}}<|end|><|assistant|>",), assistant=("{{content}}<|end|>",),
                 system=("<|system|>{{content}}<|end|>",), stop_words=("<|end|>",), replace_eos=True,
                 special_tokens=("<|user|>", "<|end|>", "<|assistant|>", "<|system|>")),
    )
}

# Templates of vision-language models: LlamaFactory's qwen2_vl is its qwen template with another default system
# prompt and the Qwen2-VL plugin, which Qwen2.5-VL uses too.
VISION_TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        Template("qwen2_vl", user=(_QWEN_USER,), assistant=(_QWEN_ANSWER,), system=(_QWEN_SYSTEM,),
                 default_system="You are a helpful assistant.", stop_words=("<|im_end|>",), replace_eos=True,
                 special_tokens=_IM, mm_plugin="qwen2_vl"),
        # LlamaFactory's qwen3_vl and qwen3_vl_nothink: its qwen3 and qwen3_nothink with the Qwen3-VL plugin,
        # which places images as Qwen2-VL's does (Qwen3-VL's image processor is Qwen2-VL's, at other settings)
        Template("qwen3_vl", user=(_QWEN_USER,), assistant=(_QWEN_ANSWER,), system=(_QWEN_SYSTEM,),
                 stop_words=("<|im_end|>",), replace_eos=True, special_tokens=_IM,
                 thought=("<think>\n", "\n</think>\n\n"), mm_plugin="qwen3_vl"),
        Template("qwen3_vl_nothink", user=(_QWEN_USER,), assistant=(_QWEN_ANSWER,), system=(_QWEN_SYSTEM,),
                 stop_words=("<|im_end|>",), replace_eos=True, special_tokens=_IM, mm_plugin="qwen3_vl"),
    )
}
TEMPLATE_NAMES = (*TEMPLATES, *VISION_TEMPLATES)  # every name `template` takes
