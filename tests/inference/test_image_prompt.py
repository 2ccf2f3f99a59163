"""Placing images in a rendered prompt: each marker becomes its image's plan text, in order, and
the placeholders of the tokenized prompt belong to the images in turn."""

from __future__ import annotations

import pytest

from modelhost.inference.contracts import InvalidRequest
from modelhost.inference.image_prompt import image_spans, place_images
from modelhost.inference.images import ImageInput
from modelhost.models.vision.tower import ImagePlan

IMAGE = 7


def plan(text: str, n_tokens: int) -> ImagePlan:
    return ImagePlan(text=text, n_tokens=n_tokens, pixels=None)


def image(digest: bytes) -> ImageInput:
    return ImageInput(b"", digest, "PNG", 1, 1)


def test_each_marker_takes_its_own_images_text_in_order() -> None:
    text = place_images("a<image>b<image>c", "<image>", [plan("[1]", 1), plan("[2]", 1)])
    assert text == "a[1]b[2]c"


@pytest.mark.parametrize("markers", ["no image here", "<image><image>"])
def test_a_count_of_markers_other_than_the_images_is_a_400(markers: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        place_images(markers, "<image>", [plan("[1]", 1)])
    assert "but the request carries 1" in caught.value.message


def test_placeholders_go_to_the_images_in_turn_even_split_into_tiles() -> None:
    ids = [1, IMAGE, IMAGE, 3, IMAGE, 2, IMAGE, IMAGE, 4]
    first, second = image_spans(ids, IMAGE, [image(b"a"), image(b"b")], [plan("", 3), plan("", 2)])
    assert (first.start, first.length, first.positions, first.digest) == (1, 4, (1, 2, 4), b"a")
    assert (second.start, second.length, second.positions, second.digest) == (6, 2, (6, 7), b"b")


def test_a_placeholder_typed_in_the_text_is_a_400() -> None:
    with pytest.raises(InvalidRequest) as caught:
        image_spans([IMAGE, IMAGE, IMAGE], IMAGE, [image(b"a")], [plan("", 2)])
    assert "3 image placeholder tokens where its images need 2" in caught.value.message
