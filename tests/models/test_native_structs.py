"""The native library and its ctypes mirrors agree on every struct's size, checked when the
library loads (models/kernels/native.py's check_struct_sizes), so a field changed on one side
only is a clear error rather than a kernel reading memory at the wrong offsets."""

from __future__ import annotations

import ctypes

import pytest

from modelhost.models.kernels import native
from modelhost.models.kernels.structs import STRUCTS, NativeLayer


class ReportedSizes:
    """A stand-in for the library: `mh_struct_size` answers from `sizes`."""

    def __init__(self, sizes: list[int]) -> None:
        def mh_struct_size(which: int) -> int:
            return sizes[which] if which < len(sizes) else -1

        self.mh_struct_size = mh_struct_size


def test_a_library_whose_struct_sizes_match_the_mirrors_is_accepted():
    native.check_struct_sizes(ReportedSizes([ctypes.sizeof(s) for s in STRUCTS]))


def test_a_struct_of_another_size_is_refused_with_its_name_and_both_sizes():
    sizes = [ctypes.sizeof(s) for s in STRUCTS]
    which = STRUCTS.index(NativeLayer)
    sizes[which] += 8  # a field the C++ side gained and ctypes did not
    expected = ctypes.sizeof(NativeLayer)
    with pytest.raises(native.StructMismatch) as refused:
        native.check_struct_sizes(ReportedSizes(sizes))
    message = str(refused.value)
    assert f"NativeLayer is {expected + 8} bytes there and {expected} in ctypes" in message
    assert "models/kernels/structs.py" in message


@pytest.mark.skipif(native.kernels() is None, reason="no g++, or neither AVX-512 VNNI nor AVX2")
def test_the_built_library_reports_every_mirror_s_size():
    kernels = native.kernels()
    assert kernels is not None
    size = kernels.library.mh_struct_size
    assert [size(which) for which in range(len(STRUCTS))] == [ctypes.sizeof(s) for s in STRUCTS]
    assert size(len(STRUCTS)) == -1
