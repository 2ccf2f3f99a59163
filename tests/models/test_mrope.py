"""M-RoPE positions of a row (models/vision/mrope.py) and the rotary that reads them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelhost.models.networks.layers import Rotary
from modelhost.models.vision.mrope import mrope_positions, step_mrope_positions
from modelhost.models.vision.qwen2_5_vl_image import mrope_offsets
from modelhost.models.vision.tower import ImagePlan


@dataclass(frozen=True)
class Placed:
    start: int
    plan: ImagePlan


def image_at(start: int, rows: int, cols: int) -> Placed:
    """An image of rows x cols merged patches whose placeholders start at `start`."""
    offsets = mrope_offsets((1, rows * 2, cols * 2), merge=2)
    return Placed(start, ImagePlan("", rows * cols, None, offsets))


def test_text_before_an_image_takes_its_index_on_every_axis():
    got = mrope_positions(torch.arange(3), [image_at(3, 2, 3)])
    assert got.tolist() == [[0, 1, 2]] * 3


def test_image_tokens_take_their_row_and_column_from_the_image_start():
    # 2 x 3 merged patches at indices 2..7: (start + frame, start + row, start + column)
    got = mrope_positions(torch.arange(2, 8), [image_at(2, 2, 3)])
    assert got.tolist() == [
        [2, 2, 2, 2, 2, 2],
        [2, 2, 2, 3, 3, 3],
        [2, 3, 4, 2, 3, 4],
    ]


def test_text_after_an_image_continues_one_past_its_largest_position():
    # 2 x 3 image at 2..7: its largest position is 2 + 2 = 4, so index 8 takes 5.
    got = mrope_positions(torch.tensor([8, 9]), [image_at(2, 2, 3)])
    assert got.tolist() == [[5, 6]] * 3


def test_a_second_image_starts_where_the_text_before_it_left_off():
    first, second = image_at(1, 2, 2), image_at(7, 1, 2)  # text at 0, 5, 6, then 9
    got = mrope_positions(torch.arange(10), [first, second])
    # first image: 1..4 -> (1, 1+r, 1+c); max 2, so index 5 -> 3, 6 -> 4
    # second: index 7 -> base 7 - 2 = 5: (5, 5, 5), (5, 5, 6); then index 9 -> 7
    assert got.tolist() == [
        [0, 1, 1, 1, 1, 3, 4, 5, 5, 7],
        [0, 1, 1, 2, 2, 3, 4, 5, 5, 7],
        [0, 1, 2, 1, 2, 3, 4, 5, 6, 7],
    ]


def test_any_slice_of_a_row_gets_the_positions_of_the_whole():
    images = [image_at(1, 2, 2), image_at(7, 1, 2)]
    whole = mrope_positions(torch.arange(12), images)
    for chunk in (torch.arange(3, 8), torch.tensor([11]), torch.tensor([0, 4, 9])):
        assert torch.equal(mrope_positions(chunk, images), whole[:, chunk])


def test_a_plan_without_offsets_leaves_positions_as_indices():
    plain = Placed(1, ImagePlan("", 4, None))
    assert mrope_positions(torch.arange(6), [plain]).tolist() == [list(range(6))] * 3


def test_a_step_without_mrope_images_needs_no_positions():
    plain = Placed(1, ImagePlan("", 4, None))
    assert step_mrope_positions(torch.arange(6), [6], [[plain]]) is None
    assert step_mrope_positions(torch.arange(6), [3, 3], [[], []]) is None


def test_a_step_lays_each_rows_positions_after_the_last():
    # row 0: a decode token at index 9 after a 2 x 2 image at 1; row 1: text only
    positions = torch.tensor([9, 0, 1, 2])
    got = step_mrope_positions(positions, [1, 3], [[image_at(1, 2, 2)], []])
    assert got is not None
    assert got.tolist() == [[7, 0, 1, 2]] * 3


def test_sections_pick_each_frequency_pairs_axis():
    rotary = Rotary(16, 10_000.0)
    positions = torch.tensor([[3, 5], [7, 11], [13, 17]])
    cos, sin = rotary.cos_sin_sections(positions, (2, 3, 3), torch.float32)
    per_axis = [rotary.cos_sin(axis, torch.float32) for axis in positions]
    axis_of_pair = [0, 0, 1, 1, 1, 2, 2, 2]
    for dim in range(16):
        axis = axis_of_pair[dim % 8]
        assert torch.equal(cos[..., dim], per_axis[axis][0][..., dim])
        assert torch.equal(sin[..., dim], per_axis[axis][1][..., dim])


def test_equal_axes_give_the_plain_rotary():
    rotary = Rotary(16, 10_000.0)
    positions = torch.arange(20)
    cos, sin = rotary.cos_sin_sections(positions.expand(3, -1), (2, 3, 3), torch.float32)
    plain = rotary.cos_sin(positions, torch.float32)
    assert torch.equal(cos, plain[0]) and torch.equal(sin, plain[1])
