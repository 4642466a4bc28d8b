"""Chat messages -> prompt text, with the tokenizer's chat template.

Tokenizers without a template (such as the tiny test tokenizers) get FALLBACK_CHAT_TEMPLATE:

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

one `<|role|>` line and the content per message, then `<|assistant|>` and a newline when a
generation prompt is asked for. `nanokv serve --chat-template FILE` and
`LLM.chat(chat_template=...)` override both.
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
               template_kwargs: dict | None = None, continue_final_message: bool = False,
               tools: list[dict] | None = None) -> str:
        """template_kwargs: extra template variables (vLLM's chat_template_kwargs, such as
        Qwen3's enable_thinking). continue_final_message: the last message left open (the
        rendering ends where its content does), for the model to continue it. tools: the
        OpenAI tool definitions, the template's `tools`."""
        template_kwargs = template_kwargs or {}
        reserved = {"messages", "chat_template", "tokenize", "add_generation_prompt",
                    "continue_final_message", "tools"}
        if reserved & set(template_kwargs):
            raise ValueError(f"chat_template_kwargs must not set {sorted(reserved)}")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, **template_kwargs)
        except Exception as e:  # a template may raise on roles it does not know
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        if not isinstance(text, str):
            raise ValueError("the chat template did not produce text")
        return text

    def token_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The template output already holds any special tokens it wants (BOS ...)."""
        return list(self.tokenizer.encode(self.render(messages, add_generation_prompt),
                                          add_special_tokens=False))


ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(conversation, index: int = 0) -> list[dict]:
    """A conversation of the Python API as the template takes it: [{"role", "content"}], the
    content text (a list of {"type": "text", "text"} parts joined). `index`: the
    conversation's place in a batch, for the error messages."""
    where = f"conversation {index}"
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"{where}: a conversation is a non-empty list of message dicts")
    plain = []
    for j, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ValueError(f"{where}, message {j}: a message is a dict with 'role' and "
                             f"'content', got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}, message {j}: role must be one of {list(ROLES)}, got "
                             f"{role!r}")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise ValueError(f"{where}, message {j}: content parts must be "
                                 f"{{'type': 'text', 'text': str}} (text models only)")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"{where}, message {j}: content must be a string or a list of "
                             f"text parts, got {type(content).__name__}")
        plain.append({"role": role, "content": content})
    return plain
