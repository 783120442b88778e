"""The tokenizer and records the template goldens are made of, built in code (no download).

`make_template_goldens.py` (which runs LlamaFactory) and `tests/test_templates.py`
(which runs hp) both import this module, so both sides tokenize with the
same ids: hp's byte-level HF tokenizer (bytes 0-255, pad 256, bos `<s>` 257,
eos `</s>` 258) plus, from 259 on, the special tokens the templates spell,
two ordinary added tokens for Qwen3's thought tags, and from 275 on the
special tokens of the templates added later. Byte-level with no
merges, a text's ids do not depend on how it is split, which lets a test
compare hp's ids with one `apply_chat_template` rendering.
"""

from __future__ import annotations

from hp.train.data import ByteTokenizer

SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>",  # chatml, qwen
    "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",  # llama3
    "<start_of_turn>", "<end_of_turn>", "<eos>",  # gemma
    "<|user|>", "<|assistant|>", "<|system|>", "<|end|>",  # phi
)
THOUGHT_TOKENS = ("<think>", "</think>")  # added, not special, as in Qwen3's tokenizer
# The special tokens (stop words and thought tags too) of the templates added later: after the thought tokens, so
# that every id above, and with it every earlier golden, stays as it was
LATER_SPECIAL_TOKENS = (
    "<|start_of_role|>", "<|end_of_role|>",  # granite
    "[gMASK]", "<sop>", "<|observation|>",  # glm4
    "<｜User｜>", "<｜Assistant｜>",  # deepseek3
    "<|start|>", "<|message|>", "<|channel|>",  # gpt_oss
    "<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>",  # cohere
    "<|SYSTEM_TOKEN|>",
    "[|user|]", "[|assistant|]", "[|system|]", "[|endofturn|]",  # exaone
    "<|begin_of_sentence|>", "<|end_of_sentence|>",  # ernie_nothink
    "<beginning_of_sentence>", "<end_of_sentence>", "]~!b[", "]~b]", "[e~[",  # minimax1, minimax2
    "<seed:think>", "</seed:think>",  # seed_oss
    "<｜hy_User｜>", "<｜hy_Assistant｜>", "<｜hy_eos｜>",  # hy3
    "<|User|>", "<|Assistant|>",  # youtu
    "<|im_sep|>",  # phi4
)

# Jinja chat templates for the template-unset rule: name -> (template, whether encode("") gives bos).
CHAT_TEMPLATES: dict[str, tuple[str, bool]] = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        False,
    ),
    "chatml_default_system": (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        False,
    ),
    "chatml_thinking": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' and '<think>' not in m['content'] %}{{ '<think>\\n\\n</think>\\n\\n' }}"
        "{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        False,
    ),
    "llama3_bos": (
        "{{ bos_token }}{% for m in messages %}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{% endif %}",
        True,
    ),
}

# Conversations: (role, text) turns alternating from a user turn, ending with an answer; "" = no system prompt.
RECORDS: dict[str, dict] = {
    "single": {"system": "", "turns": [["user", "What is 2+2?"], ["assistant", "4"]]},
    "system": {"system": "You are terse.", "turns": [["user", "Name a colour."], ["assistant", "Blue."]]},
    "multi": {"system": "", "turns": [
        ["user", "Hi"], ["assistant", "Hello! How can I help?"],
        ["user", "Tell me a joke."], ["assistant", "Why did the chicken cross the road?"],
        ["user", "Why?"], ["assistant", "To get to the other side."],
    ]},
    "unicode": {"system": "Réponds en allemand.", "turns": [
        ["user", "Übersetze: 你好, 世界 🌍"], ["assistant", "Hallo, Welt 🌍 — ça va?"],
        ["user", "Et « merci » ?"], ["assistant", "Danke ✓"],
    ]},
    "braces_and_thought": {"system": "", "turns": [
        ["user", "Fill {x} in {{content}}"], ["assistant", "<think>\nx is 1\n</think>\n\n{x} = 1"],
    ]},
    "thoughts": {"system": "", "turns": [  # a thought in an earlier answer, none in the next, one in the last
        ["user", "2+2?"], ["assistant", "<think>\nadd them\n</think>\n\n4"],
        ["user", "And 3+3?"], ["assistant", "6"],
        ["user", "Sure?"], ["assistant", "<think>\ncheck: 3+3 is 6\n</think>\n\nYes, 6."],
    ]},
}

# (record, cutoff_len) pairs: every record whole, and the long ones cut at a few lengths.
CASES = [(name, 1024) for name in RECORDS] + [("multi", 12), ("multi", 40), ("multi", 70), ("unicode", 30)]

# LlamaFactory's data arguments that change the sft encoding, each set tried on some templates (by name), some
# Jinja chat templates of CHAT_TEMPLATES (read with `template` unset) and some (record, cutoff_len) pairs. The
# sets LlamaFactory refuses are here too: the goldens keep its error instead of ids.
_SYSTEM = "Answer in one word.\n"  # a newline of its own: the text is taken as written
OPTION_CASES: list[tuple[dict, tuple[str, ...], tuple[str, ...], list[tuple[str, int]]]] = [
    ({"train_on_prompt": True}, ("default", "qwen", "llama3", "llama2", "gemma"),
     ("chatml_default_system", "llama3_bos"), [("system", 1024), ("multi", 1024), ("multi", 40)]),
    ({"train_on_prompt": True}, ("gemma2", "falcon"), (), [("single", 1024)]),  # efficient_eos: refused
    ({"train_on_prompt": True, "mask_history": True}, ("default",), (), [("single", 1024)]),  # refused
    ({"mask_history": True}, ("default", "qwen", "llama3", "mistral", "gemma2", "falcon", "qwen3"),
     ("chatml", "chatml_thinking"),
     [("multi", 1024), ("multi", 40), ("multi", 70), ("unicode", 30), ("thoughts", 1024)]),
    ({"mask_history": True, "preserve_thinking": True}, ("qwen3",), ("chatml_thinking",),
     [("thoughts", 1024), ("thoughts", 40)]),
    ({"preserve_thinking": True}, ("qwen3",), (), [("thoughts", 1024)]),  # nothing to preserve without mask_history
    ({"default_system": _SYSTEM}, ("default", "alpaca", "qwen", "llama2", "gemma", "vicuna"),
     ("chatml_default_system",), [("single", 1024), ("system", 1024)]),
    ({"default_system": ""}, ("alpaca", "qwen"), ("chatml_default_system",), [("single", 1024)]),
    ({"enable_thinking": False}, ("qwen3", "qwen3_nothink", "qwen"), ("chatml_thinking",),
     [("single", 1024), ("braces_and_thought", 1024), ("thoughts", 1024), ("multi", 40)]),
    ({"enable_thinking": None}, ("qwen3",), ("chatml_thinking",), [("single", 1024), ("thoughts", 1024)]),
    ({"enable_thinking": False, "train_on_prompt": True}, ("qwen3",), (), [("thoughts", 1024)]),
    ({"enable_thinking": False, "mask_history": True}, ("qwen3",), ("chatml_thinking",),
     [("thoughts", 1024), ("thoughts", 50)]),
    ({"mask_history": True, "default_system": _SYSTEM}, ("llama2", "qwen"), (), [("multi", 60)]),
    # the templates added later: their efficient_eos, Llama-2 style, eos-in-the-user-turn and reasoning formats
    ({"train_on_prompt": True}, ("glm4", "gpt_oss"), (), [("single", 1024)]),  # efficient_eos: refused
    ({"train_on_prompt": True}, ("olmo", "ministral", "exaone", "seed_oss"), (), [("system", 1024), ("multi", 40)]),
    ({"mask_history": True}, ("glm4", "glm4_7", "gpt_oss", "deepseekr1", "exaone", "seed_oss"), (),
     [("multi", 40), ("thoughts", 1024), ("thoughts", 40)]),
    ({"mask_history": True, "preserve_thinking": True}, ("glm4_7", "gpt_oss"), (), [("thoughts", 1024)]),
    ({"enable_thinking": False}, ("glm4_moe", "glm4_7", "deepseekr1", "gpt_oss", "minimax2", "mimo_v2", "seed_oss",
                                  "hy3", "youtu"), (), [("single", 1024), ("thoughts", 1024)]),
    ({"enable_thinking": None}, ("glm4_7", "gpt_oss"), (), [("single", 1024), ("thoughts", 1024)]),
    ({"default_system": _SYSTEM}, ("granite4", "gpt_oss", "ministral", "intern2", "smollm2"), (),
     [("single", 1024), ("system", 1024)]),
    ({"default_system": ""}, ("gpt_oss", "smollm2"), (), [("single", 1024)]),
]


def golden_tokenizer(chat_template: str | None = None):
    """The goldens' HF tokenizer; with `chat_template` (a CHAT_TEMPLATES name) it carries that Jinja template.

    >>> tok = golden_tokenizer()
    >>> tok.encode("<|im_start|>hi<think>", add_special_tokens=False)
    [259, 104, 105, 273]
    >>> golden_tokenizer("llama3_bos").encode("")  # this one adds bos, like Llama's tokenizers
    [257]
    """
    hf = ByteTokenizer().as_hf()
    hf.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    hf.add_tokens(list(THOUGHT_TOKENS))
    hf.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS, *LATER_SPECIAL_TOKENS]})
    if chat_template is not None:
        text, adds_bos = CHAT_TEMPLATES[chat_template]
        hf.chat_template = text
        if adds_bos:
            from tokenizers import processors

            hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", hf.bos_token_id)]
            )
    return hf


def messages(record: dict) -> list[dict[str, str]]:
    """A record's turns as chat messages (role and content), the system prompt first when there is one."""
    system = [{"role": "system", "content": record["system"]}] if record["system"] else []
    return system + [{"role": role, "content": text} for role, text in record["turns"]]
