"""The stop matcher: what a user sees of a stream that hits (or nearly hits) a stop string."""

from __future__ import annotations

from modelhost.text.stop import StopMatcher


def _shown(matcher: StopMatcher, deltas: list[str]) -> tuple[str, str | None]:
    """Everything the user would see after these deltas and the matched stop string, if any."""
    shown, matched = "", None
    for delta in deltas:
        text, matched = matcher.push(delta)
        shown += text
    return shown + matcher.flush(), matched


def test_stop_matcher_passes_text_through_when_it_has_no_stops() -> None:
    matcher = StopMatcher([])

    assert matcher.push("hello </") == ("hello </", None)


def test_stop_matcher_ignores_empty_stop_strings_when_given_some() -> None:
    matcher = StopMatcher(["", "END"])

    assert _shown(matcher, ["a", "b"]) == ("ab", None)


def test_stop_matcher_cuts_the_text_before_the_stop_when_it_arrives_in_one_delta() -> None:
    matcher = StopMatcher(["</s>"])

    assert matcher.push("hello</s>world") == ("hello", "</s>")


def test_stop_matcher_never_emits_a_stop_when_it_is_split_across_deltas() -> None:
    matcher = StopMatcher(["</end>"])

    pushes = [matcher.push(delta) for delta in ["hello </", "en", "d> trailing"]]

    assert pushes == [("hello ", None), ("", None), ("", "</end>")]


def test_stop_matcher_returns_nothing_more_when_pushed_after_a_match() -> None:
    matcher = StopMatcher(["STOP"])
    matcher.push("aSTOPb")

    assert (matcher.push("more"), matcher.flush()) == (("", "STOP"), "")


def test_stop_matcher_reports_the_earliest_stop_when_several_occur() -> None:
    matcher = StopMatcher(["world", "lo"])

    assert matcher.push("hello world") == ("hel", "lo")


def test_stop_matcher_stops_at_once_when_a_stop_completes_inside_a_longer_open_one() -> None:
    matcher = StopMatcher(["abcd", "bc"])

    assert _shown(matcher, ["xa", "bc", "d"]) == ("xa", "bc")


def test_stop_matcher_releases_held_text_when_flushed() -> None:
    matcher = StopMatcher(["</answer>"])

    assert (matcher.push("42 </ans"), matcher.flush()) == (("42 ", None), "</ans")


def test_stop_matcher_emits_held_text_when_the_next_delta_breaks_the_prefix() -> None:
    matcher = StopMatcher(["</s>"])
    matcher.push("a </")

    assert matcher.push("b>") == ("</b>", None)


def test_stop_matcher_holds_only_the_longest_possible_prefix_when_stops_overlap() -> None:
    matcher = StopMatcher(["aab"])

    pushes = [matcher.push(delta) for delta in ["xaa", "a", "b"]]

    assert pushes == [("x", None), ("a", None), ("", "aab")]


def test_stop_matcher_holds_a_prefix_of_any_stop_when_there_are_several() -> None:
    matcher = StopMatcher(["STOP", "<|end|>"])

    assert _shown(matcher, ["one ST", "two <|e", "nd|> three"]) == ("one STtwo ", "<|end|>")


def test_stop_matcher_shows_all_text_when_no_stop_ever_completes() -> None:
    deltas = ["Hel", "lo, </", "s", "> is not </st", "ep>"]
    matcher = StopMatcher(["</stop>"])

    assert _shown(matcher, deltas) == ("".join(deltas), None)
