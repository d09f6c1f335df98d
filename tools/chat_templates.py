"""Chat templates for a GGUF file that lacks one: a known family's, where the family is certain, else none (a base
model: chats become plain completion, nodes/generation/text.py).

Certain means both: the file's architecture and special tokens are the family's, and its name says it was tuned
to chat (a base model of the same family shares its tokens but was never taught its turns).
"""

import re

# The families' own formats, as their Hugging Face tokenizer_config.json writes them (system turns kept simple).
GEMMA = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
    " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# (architectures, tokens the file must have, the template)
FAMILIES = (
    (("gemma", "gemma2", "gemma3"), ("<start_of_turn>", "<end_of_turn>"), GEMMA),
    (("qwen2", "qwen3", "qwen2moe", "qwen3moe"), ("<|im_start|>", "<|im_end|>"), CHATML),
    (("llama",), ("<|start_header_id|>", "<|eot_id|>"), LLAMA3),
)
TUNED = re.compile(r"(^|[^a-z])(it|instruct|chat)([^a-z]|$)", re.IGNORECASE)  # "gemma-3-270m-it", "Qwen2.5 Instruct"


def family_template(architecture: str, names: list[str], tokens: set[str]) -> str | None:
    """The template of a chat-tuned model of a known family; None where either is uncertain. names: what the file
    calls the model (general.name, general.finetune, the file's name)."""
    if not any(TUNED.search(n) for n in names if n):
        return None
    for archs, needed, template in FAMILIES:
        if architecture in archs and all(t in tokens for t in needed):
            return template
    return None
