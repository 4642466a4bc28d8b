"""Chat messages -> prompt text, with the tokenizer's chat template.

Tokenizers without a template (such as the tiny test tokenizers) get FALLBACK_CHAT_TEMPLATE:

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

one `<|role|>` line and the content per message, then `<|assistant|>` and a newline when a
generation prompt is asked for. `nanokv serve --chat-template FILE` overrides both.
"""

from __future__ import annotations

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatRenderer:
    def __init__(self, tokenizer, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        self.template = template or own or FALLBACK_CHAT_TEMPLATE
        self.source = "--chat-template" if template else ("tokenizer" if own else "fallback")

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               template_kwargs: dict | None = None) -> str:
        """template_kwargs: extra template variables (vLLM's chat_template_kwargs, such as
        Qwen3's enable_thinking)."""
        template_kwargs = template_kwargs or {}
        reserved = {"messages", "chat_template", "tokenize", "add_generation_prompt"}
        if reserved & set(template_kwargs):
            raise ValueError(f"chat_template_kwargs must not set {sorted(reserved)}")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **template_kwargs)
        except Exception as e:  # a template may raise on roles it does not know
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        if not isinstance(text, str):
            raise ValueError("the chat template did not produce text")
        return text

    def token_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The template output already holds any special tokens it wants (BOS ...)."""
        return list(self.tokenizer.encode(self.render(messages, add_generation_prompt),
                                          add_special_tokens=False))
