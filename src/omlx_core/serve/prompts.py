"""Requests into prompt tokens: chat templates, reasoning effort, raw completions.

Reasoning effort follows the model's settings: `chat.reasoning_effort` is the value when
a request gives none; `chat.reasoning_effort_force` makes that value win over the
request's; the value `custom` stands for `chat.reasoning_effort_custom`. It reaches the
template only when the template reads a `reasoning_effort` variable; other templates
would ignore it anyway.
"""

from omlx_core.serve.errors import bad_request
from omlx_core.serve.protocol import ChatCompletionRequest, CompletionRequest

CUSTOM = "custom"


def reasoning_effort(requested: str | None, settings) -> str | None:
    """The effort to pass to the template, from the request and the model's settings."""
    configured = settings["chat.reasoning_effort"]
    value = requested
    if value is None or (settings["chat.reasoning_effort_force"] and configured is not None):
        value = configured
    if value == CUSTOM:
        value = settings["chat.reasoning_effort_custom"]
        if value is None:
            raise bad_request("reasoning_effort 'custom' needs the model setting "
                              "chat.reasoning_effort_custom; set it with `omlx settings set "
                              "chat.reasoning_effort_custom VALUE --model …`", "reasoning_effort")
    return value


def template_takes_effort(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "reasoning_effort" in (template if isinstance(template, str) else str(template))


def chat_prompt(model, body: ChatCompletionRequest) -> tuple[list[int], str | None]:
    """Token ids of the rendered chat, and the reasoning effort that went into it."""
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(f"model {model.id!r} has no chat template; use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    effort = reasoning_effort(body.reasoning_effort, model.settings)
    extra = {"reasoning_effort": effort} if effort is not None and template_takes_effort(tokenizer) else {}
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    except Exception as error:  # noqa: BLE001 - a template that rejects the conversation is a 400
        raise bad_request(f"the chat template of {model.id!r} rejected these messages: {error}",
                          "messages") from error
    return tokenizer.encode(text, add_special_tokens=False), (effort if extra else None)


def completion_prompt(model, body: CompletionRequest) -> list[int]:
    if isinstance(body.prompt, str):
        if not body.prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return model.tokenizer.encode(body.prompt)
    vocab = model.vocab_size
    bad = next((t for t in body.prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"prompt token {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
    return list(body.prompt)
