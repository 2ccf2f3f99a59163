"""The tokenizer and chat template of one model, behind one small interface."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.sandbox

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The conversation could not be rendered with the model's template."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


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
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.eos_token_ids = frozenset(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.vocab_size: int = backend.get_vocab_size()
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            env.filters["tojson"] = _tojson
            self._template = env.from_string(chat_template)

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


def _tojson(value: Any, indent: int | None = None) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, indent=indent)
