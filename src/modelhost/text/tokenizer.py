"""The tokenizer and chat template of one model, behind one small interface.

Chat templates are the model's own Jinja, rendered in an immutable sandbox with what real
templates call besides Jinja's built-ins, as transformers provides them: `raise_exception`,
`strftime_now` (Llama 3.x and SmolLM3 print today's date), `tojson` with its keyword arguments,
loop controls (`break` / `continue`) and the `{% generation %}` block (SmolLM3 marks assistant
turns with it for training masks; here it renders its body).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

Message = Mapping[str, Any]


_SYSTEM_TOOLS = "<|tool|>"  # where Phi-4-mini's template prints a system message's `tools`


class ChatTemplateError(ValueError):
    """The conversation could not be rendered with the model's template."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer`; renders chat templates in a sandboxed Jinja env.

    `chat_template` comes from the model's files, else from its family's built-in fallback.
    """

    def __init__(
        self,
        backend: Any,
        *,
        chat_template: str | None,
        eos_token_ids: Iterable[int],
        add_bos_token: bool,
        bos_token: str | None,
        eos_token: str | None,
        markup_tokens: Iterable[str] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.eos_token_ids = frozenset(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.vocab_size: int = backend.get_vocab_size()
        # What generated ids are decoded with: special tokens dropped, the family's markup kept.
        self.stream_decoder = _markup_keeping_decoder(backend, markup_tokens)
        self.reads_system_tools = False  # the template wants tools in the system message
        self.renders_tools = False  # the template prints the `tools` variable
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            try:
                self._template = env.from_string(chat_template)
                variables = jinja2.meta.find_undeclared_variables(env.parse(chat_template))
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"the chat template does not parse: {exc}") from exc
            # Phi-4-mini's: declarations read from the system message, never from `tools`.
            self.reads_system_tools = "tools" not in variables and _SYSTEM_TOOLS in chat_template
            self.renders_tools = "tools" in variables

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS where the model wants one."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The readable text of one token, as logprobs show it."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        try:
            return self._template.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **template_kwargs,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc

    def encode_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render then tokenize; the template writes BOS itself where it wants one."""
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    """Jinja's `tojson` as chat templates expect it: not HTML-escaped (a template's JSON is
    prompt text, not markup), non-ASCII kept, with json.dumps' layout arguments."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _MarkupKeepingDecoder:
    """Decodes as `skip_special_tokens=True` does, except that the special tokens a family writes
    its markup with (`<|python_tag|>`, `[TOOL_CALLS]`, `<|tool_call|>`...) stay in the text, so
    the tool-call and reasoning parsers see them (and drop them there)."""

    def __init__(self, backend: Any, dropped: frozenset[int]) -> None:
        self._backend = backend
        self._dropped = dropped

    def decode(self, ids: list[int], /, *, skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            ids = [token_id for token_id in ids if token_id not in self._dropped]
        text: str = self._backend.decode(ids, skip_special_tokens=False)
        return text


def _markup_keeping_decoder(backend: Any, markup_tokens: Iterable[str]) -> Any:
    """The backend itself when none of the markup is a special token (nothing to keep)."""
    added = getattr(backend, "get_added_tokens_decoder", None)
    if added is None:
        return backend
    special = {token_id: token.content for token_id, token in added().items() if token.special}
    kept = frozenset(markup_tokens)
    if not any(content in kept for content in special.values()):
        return backend
    dropped = frozenset(token_id for token_id, content in special.items() if content not in kept)
    return _MarkupKeepingDecoder(backend, dropped)
