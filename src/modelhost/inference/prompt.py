"""Building a request's prompt ids: raw text, or the conversation through the chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from modelhost.inference.contracts import (
    ChatPrompt,
    InferenceRequest,
    InvalidRequest,
    TextPrompt,
    TokenPrompt,
)
from modelhost.models.families import Family
from modelhost.models.loaded import LoadedModel
from modelhost.text.tokenizer import ChatTemplateError, Tokenizer
from modelhost.text.tool_calls import TOOL_CODE
from modelhost.text.tool_code import tool_code_messages
from modelhost.text.tool_prompt import builtin_tool_messages, custom_as_function
from modelhost.text.turns import (
    fixed_length_call_ids,
    has_later_system_turn,
    later_system_in_user_turns,
    system_declared_tools,
    system_in_first_user_turn,
)


def prompt_ids_for(
    model: LoadedModel, request: InferenceRequest, instruction: str | None = None
) -> list[int]:
    """The ids to prefill; `instruction` (structured output not enforced) joins the system text."""
    tokenizer = model.tokenizer
    prompt = request.prompt
    if isinstance(prompt, TokenPrompt):
        return checked_token_ids(model, prompt)
    if isinstance(prompt, TextPrompt):
        return tokenizer.encode(prompt.text, add_special_tokens=True)
    return tokenizer.encode(
        chat_text(model, request, prompt, instruction), add_special_tokens=False
    )


def chat_text(
    model: LoadedModel, request: InferenceRequest, prompt: ChatPrompt, instruction: str | None
) -> str:
    """The conversation rendered by the model's chat template, ready to tokenize (the template
    writes BOS itself where it wants one)."""
    tokenizer = model.tokenizer
    if not tokenizer.has_chat_template:
        raise InvalidRequest("prompt build failed: this model has no chat template")
    messages: Sequence[Mapping[str, Any]] = _with_instruction(prompt.messages, instruction)
    messages, tools = template_inputs(model.family, tokenizer, messages, prompt.tools)
    kwargs: dict[str, Any] = dict(prompt.template_kwargs)
    if request.thinking is not None:
        kwargs[model.family.thinking_switch] = request.thinking
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools, **kwargs)
    except (ChatTemplateError, TypeError, ValueError, KeyError) as exc:
        if not has_later_system_turn(messages):
            raise InvalidRequest(f"prompt build failed: {exc}") from exc
        failure = exc
    # The template takes no system turn past the first (it raised): each joins a user turn.
    messages = later_system_in_user_turns(messages)
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools, **kwargs)
    except (ChatTemplateError, TypeError, ValueError, KeyError):
        raise InvalidRequest(f"prompt build failed: {failure}") from failure


def template_inputs(
    family: Family,
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None]:
    """The conversation and tools in the shape the model's template renders correctly."""
    form = tool_form(family, tokenizer)
    if _uses_tools(messages, tools):
        if form == "builtin":
            messages, tools = builtin_tool_messages(messages, tools), None  # in the system text
        else:
            messages, tools = custom_as_function(messages, tools)
        if form == "tool_code":
            messages, tools = tool_code_messages(messages, tools), None  # declared in the text
        elif form == "system":
            markers = family.tool_call_markers or ("", "")
            messages, tools = system_declared_tools(messages, tools, markers), None
    if not family.system_role:
        messages = system_in_first_user_turn(messages)
    if family.tool_call_id_length is not None:
        messages = fixed_length_call_ids(messages, family.tool_call_id_length)
    return messages, tools


def tool_form(family: Family, tokenizer: Tokenizer) -> str:
    """Where a model reads tools: Gemma's `tool_code` turns, the system message's `tools`
    (Phi-4-mini), its own template (`template`), or, when the template cannot render them at
    all, the built-in tool prompt (`builtin`)."""
    if family.tool_call_markers == TOOL_CODE:
        return "tool_code"
    if family.tool_call_markers and tokenizer.reads_system_tools:
        return "system"
    return "template" if tokenizer.renders_tools else "builtin"


def checked_token_ids(model: LoadedModel, prompt: TokenPrompt) -> list[int]:
    """The prompt's ids; a 400 naming the first one the model has no token for."""
    vocabulary = min(model.config.vocab_size, model.tokenizer.vocab_size)
    for index, token_id in enumerate(prompt.token_ids):
        if not 0 <= token_id < vocabulary:
            message = (
                f"{prompt.field}[{index}] is {token_id}, not a token id of this model "
                f"(its vocabulary is 0 to {vocabulary - 1})"
            )
            raise InvalidRequest(message, param="prompt")
    return list(prompt.token_ids)


def _with_instruction(
    messages: Sequence[Mapping[str, Any]], instruction: str | None
) -> list[Mapping[str, Any]]:
    """The conversation with a structured-output instruction folded into its system message."""
    if instruction is None:
        return list(messages)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{instruction}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


def _uses_tools(messages: Sequence[Mapping[str, Any]], tools: object) -> bool:
    return bool(tools) or any(
        message.get("role") == "tool" or message.get("tool_calls") for message in messages
    )
