"""A test-only vision-language model: SmolLM2 with a fake vision tower, and real image files.

The tower reads an image's colour: `plan` shrinks it to 8x8 pixels (Pillow, then a tensor) and
lays out its placeholders as two "tiles" of three `<empty_output>` tokens with a separator
between them (real towers split images into tiles too); `encode` gives every placeholder the
embedding of the colour word the pixels are closest to (" red", " green", " blue", ...), so
greedy answers about a red and a blue image differ, and the same image always reads the same.

The networks apply `ForwardBatch.embed_override` themselves once the vision branch lands; until
then `OverridingNetwork` applies it around SmolLM2's embedding table (idempotent after: the
same rows replace the same rows).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import threading
from typing import Any

import torch
from PIL import Image

from modelhost.models.batch import ForwardBatch, KVCache
from modelhost.models.loaded import LoadedModel
from modelhost.models.vision.tower import ImagePlan
from modelhost.text.tokenizer import Tokenizer

MARKER = "<image>"
PLACEHOLDER = "<empty_output>"  # SmolLM2's id 16: a special token no chat text produces
SEPARATOR = "<jupyter_text>"
TILE_TOKENS = 3
IMAGE_TOKENS = 2 * TILE_TOKENS
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 200, 40),
    "blue": (30, 40, 220),
    "yellow": (230, 220, 30),
    "black": (0, 0, 0),
    "white": (255, 255, 255),
}

# ChatML, as SmolLM2 writes it, reading content lists as the vision models' templates do.
TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class FakeTower:
    marker = MARKER
    bidirectional = False

    def __init__(self, model: LoadedModel) -> None:
        tokenizer = model.tokenizer
        image_token = tokenizer.token_id(PLACEHOLDER)
        assert image_token is not None
        self.image_token_id = image_token
        self._table = model.network.model.embed_tokens
        self._words = {
            name: tokenizer.encode(f" {name}", add_special_tokens=False)[0] for name in COLOURS
        }
        self.encoded = 0  # images encoded, for the tests that count encoder calls

    def plan(self, image: Image.Image) -> ImagePlan:
        small = image.convert("RGB").resize((8, 8))
        pixels = torch.frombuffer(bytearray(small.tobytes()), dtype=torch.uint8)
        pixels = pixels.view(64, 3).float()
        tile = PLACEHOLDER * TILE_TOKENS
        return ImagePlan(text=f"{tile}{SEPARATOR}{tile}", n_tokens=IMAGE_TOKENS, pixels=pixels)

    def encode(self, plan: ImagePlan) -> torch.Tensor:
        self.encoded += 1
        mean = plan.pixels.mean(0)
        name = min(COLOURS, key=lambda c: float(((torch.tensor(COLOURS[c]) - mean) ** 2).sum()))
        ids = torch.tensor([self._words[name]] * IMAGE_TOKENS, dtype=torch.long)
        return self._table(ids).float()


class _Overridden(torch.nn.Module):
    """An embedding table whose output takes the step's override rows, on one thread."""

    def __init__(self, table: torch.nn.Module, override: Any, thread: int) -> None:
        super().__init__()
        self.table = table
        self.override = override
        self.thread = thread

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.table(ids)
        if threading.get_ident() != self.thread:
            return hidden  # another engine over the same weights: not its step
        index, rows = self.override
        hidden = hidden.clone()
        hidden[index] = rows.to(hidden.dtype)
        return hidden


class OverridingNetwork(torch.nn.Module):
    """SmolLM2's network, applying `embed_override` right after its embedding."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch: ForwardBatch, kv: KVCache, before_layers: Any = None) -> torch.Tensor:
        if batch.embed_override is None:
            return self.inner(batch, kv, before_layers)
        model = self.inner.model
        table = model.embed_tokens
        model.embed_tokens = _Overridden(table, batch.embed_override, threading.get_ident())
        try:
            return self.inner(batch, kv, before_layers)
        finally:
            model.embed_tokens = table


def vision_model(base: LoadedModel, model_id: str = "fake-vlm") -> LoadedModel:
    """`base` (SmolLM2) as a vision-language model with the fake tower."""
    old = base.tokenizer
    tokenizer = Tokenizer(
        old.backend,
        chat_template=TEMPLATE,
        eos_token_ids=old.eos_token_ids,
        add_bos_token=old.add_bos_token,
        bos_token=old.bos_token,
        eos_token=old.eos_token,
    )
    tokenizer.stream_decoder = old.stream_decoder
    model = dataclasses.replace(
        base,
        id=model_id,
        tokenizer=tokenizer,
        family=dataclasses.replace(base.family, vision=True),
        network=OverridingNetwork(base.network),
    )
    model.vision = FakeTower(base)
    return model


# ---------------------------------------------------------------------------------------------
# Image files


def image_bytes(colour: str = "red", fmt: str = "PNG", size: tuple[int, int] = (32, 24)) -> bytes:
    """A plain image of one of COLOURS in `fmt` (PNG, JPEG, WEBP, GIF, BMP, TIFF)."""
    image = Image.new("RGB", size, COLOURS[colour])
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def base64_of(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64_of(data)}"
