"""A prompt with images: the conversation rendered, each image's placeholders put where the
template showed it, tokenized, and the image spans the engine fills with the tower's rows.

The chat template renders an image part ({"type": "image"}) as the tower's `marker`; each marker
in the rendered text is replaced, in order, by the image's `ImagePlan.text` (which tokenizes to
`n_tokens` copies of `image_token_id`, with whatever framing the model wants around them). The
placeholders of the tokenized prompt then belong to the images in order, `n_tokens` each.

Here images are decoded and preprocessed (Pillow, the tower's `plan`); tensors are the tower's
and the engine's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modelhost.engine.sequence import ImageSpan
from modelhost.inference.contracts import ChatPrompt, InferenceRequest, InvalidRequest
from modelhost.inference.images import NO_FETCH, ImageInput, ImageLimits, decode_images
from modelhost.inference.prompt import chat_text, prompt_ids_for
from modelhost.models.loaded import LoadedModel
from modelhost.models.vision.tower import ImagePlan, VisionTower


@dataclass(frozen=True, slots=True)
class BuiltPrompt:
    ids: list[int]
    images: tuple[ImageSpan, ...] = ()


def build_prompt(
    model: LoadedModel,
    request: InferenceRequest,
    instruction: str | None = None,
    limits: ImageLimits = NO_FETCH,
) -> BuiltPrompt:
    """The ids to prefill and, for a request with images, where they are (400s for images
    that cannot be read or placed). Blocking: call it off the event loop."""
    if not request.images:
        return BuiltPrompt(prompt_ids_for(model, request, instruction))
    tower = model.vision
    if tower is None:  # the stage refuses images for a text-only model before this
        raise InvalidRequest("model has no vision sidecar")
    prompt = request.prompt
    if not isinstance(prompt, ChatPrompt):
        raise InvalidRequest("images need a chat prompt (the model's template places them)")
    images = decode_images(request.images, limits)
    plans = [_plan(tower, image, request.images[i].where) for i, image in enumerate(images)]
    text = place_images(chat_text(model, request, prompt, instruction), tower.marker, plans)
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    return BuiltPrompt(ids, image_spans(ids, tower.image_token_id, images, plans))


def _plan(tower: VisionTower, image: ImageInput, where: str) -> ImagePlan:
    try:
        return tower.plan(image.rgb())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"{where}: the image could not be prepared ({exc})") from exc


def place_images(text: str, marker: str, plans: Sequence[ImagePlan]) -> str:
    """`text` with its i-th `marker` replaced by plan i's text; a 400 when the template showed
    a different number of images than the request carries."""
    pieces = text.split(marker)
    if len(pieces) - 1 != len(plans):
        message = (
            f"the prompt shows {len(pieces) - 1} image(s) ({marker!r} in the rendered "
            f"conversation) but the request carries {len(plans)}"
        )
        raise InvalidRequest(message, param="messages")
    placed = [pieces[0]]
    for plan, piece in zip(plans, pieces[1:], strict=True):
        placed.append(plan.text)
        placed.append(piece)
    return "".join(placed)


def image_spans(
    ids: Sequence[int],
    image_token_id: int,
    images: Sequence[ImageInput],
    plans: Sequence[ImagePlan],
) -> tuple[ImageSpan, ...]:
    """Each image's placeholder positions in `ids` (its `n_tokens` in turn); a 400 when the
    prompt holds another number of placeholders (its text typed the image token itself)."""
    positions = [index for index, token in enumerate(ids) if token == image_token_id]
    wanted = sum(plan.n_tokens for plan in plans)
    if len(positions) != wanted:
        message = (
            f"the prompt holds {len(positions)} image placeholder tokens where its images "
            f"need {wanted}: its text must not contain the model's image token"
        )
        raise InvalidRequest(message, param="messages")
    spans: list[ImageSpan] = []
    taken = 0
    for image, plan in zip(images, plans, strict=True):
        mine = tuple(positions[taken : taken + plan.n_tokens])
        taken += plan.n_tokens
        spans.append(ImageSpan(mine[0], mine[-1] - mine[0] + 1, image.digest, plan, mine))
    return tuple(spans)
