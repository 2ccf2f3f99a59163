"""Ollama's wire pieces: keep_alive durations, model names, options."""

from __future__ import annotations

import pytest

from modelhost.inference.contracts import InvalidRequest, RequestError
from modelhost.server.ollama import wire


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0),
        (0, 0.0),
        (-1, -1.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("300ms", 0.3),
        ("-1", -1.0),
        ("-1m", -60.0),
        ("0", 0.0),
        ("10", 10.0),
    ],
)
def test_keep_alive_reads_seconds_and_go_durations(value: object, seconds: float) -> None:
    assert wire.keep_alive({"keep_alive": value}) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m5", True, [1], {"s": 1}])
def test_keep_alive_that_is_no_duration_is_a_400(value: object) -> None:
    with pytest.raises(InvalidRequest, match="keep_alive"):
        wire.keep_alive({"keep_alive": value})


def test_a_body_without_keep_alive_asks_none_and_a_bad_body_none_either() -> None:
    assert wire.keep_alive({}) is None
    assert wire.keep_alive_of(b'{"keep_alive": "2m"}') == 120.0
    assert wire.keep_alive_of(b"{not json") is None
    assert wire.keep_alive_of(b'{"keep_alive": "soon"}') is None


def test_a_model_is_found_by_its_id_with_or_without_latest() -> None:
    known = {"smollm2-135m-instruct", "org/model:q4"}.__contains__
    assert wire.local_id("smollm2-135m-instruct", known) == "smollm2-135m-instruct"
    assert wire.local_id("smollm2-135m-instruct:latest", known) == "smollm2-135m-instruct"
    assert wire.local_id("org/model:q4", known) == "org/model:q4"


def test_an_unknown_name_is_a_404_naming_it_and_a_missing_one_a_400() -> None:
    known = {"a"}.__contains__
    with pytest.raises(RequestError) as raised:
        wire.local_id("a:7b", known)
    assert raised.value.status == 404 and "a:7b" in raised.value.message
    with pytest.raises(InvalidRequest):
        wire.local_id(None, known)
    with pytest.raises(InvalidRequest):
        wire.local_id(7, known)


def test_listed_names_carry_a_tag() -> None:
    assert wire.listed_name("gemma-3-270m") == "gemma-3-270m:latest"
    assert wire.listed_name("org/model:q4") == "org/model:q4"


def test_options_map_to_the_sampler_and_num_predict_to_max_tokens() -> None:
    opts = {"temperature": 0.2, "top_k": 40, "repeat_penalty": 1.1, "seed": 7, "num_predict": 5}
    sampling = wire.sampling(opts)
    assert (sampling.temperature, sampling.top_k, sampling.seed) == (0.2, 40, 7)
    assert sampling.repetition_penalty == 1.1
    assert wire.max_tokens(opts) == 5
    assert wire.max_tokens({"num_predict": -1}) is None
    assert wire.options({"options": {"mirostat": 0, "num_gpu": 99}}) == {
        "mirostat": 0,
        "num_gpu": 99,
    }


def test_a_keep_alive_beyond_a_century_is_a_pin_and_nan_is_a_400() -> None:
    assert wire.keep_alive({"keep_alive": "1e400"}) == -1.0
    assert wire.keep_alive({"keep_alive": 2**64}) == -1.0
    with pytest.raises(InvalidRequest):
        wire.keep_alive({"keep_alive": float("nan")})
