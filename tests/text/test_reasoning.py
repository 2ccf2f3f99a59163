"""The reasoning splitter: thinking and answer channels of a stream that writes `<think>` tags."""

from __future__ import annotations

from modelhost.text.reasoning import ReasoningSplitter, prompt_opens_thinking

THINK = ("<think>", "</think>")


def _run(splitter: ReasoningSplitter, deltas: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for delta in deltas:
        more_reasoning, more_content = splitter.push(delta)
        reasoning, content = reasoning + more_reasoning, content + more_content
    more_reasoning, more_content = splitter.flush()
    return reasoning + more_reasoning, content + more_content


def test_a_think_block_goes_to_reasoning_and_the_rest_to_content() -> None:
    text = "<think>\nThe user greets me.\n</think>\n\nHello!"

    assert _run(ReasoningSplitter(THINK), [text]) == ("The user greets me.\n", "Hello!")


def test_tags_split_across_every_character_never_reach_either_channel() -> None:
    text = "<think>plan</think>answer"

    reasoning, content = _run(ReasoningSplitter(THINK), list(text))

    assert (reasoning, content) == ("plan", "answer")


def test_text_without_tags_is_all_content() -> None:
    assert _run(ReasoningSplitter(THINK), list("a < b, <th")) == ("", "a < b, <th")


def test_a_prompt_that_opened_the_block_makes_the_first_text_reasoning() -> None:
    splitter = ReasoningSplitter(THINK, start_in_thinking=True)

    assert _run(splitter, ["plan", "</thi", "nk>answer"]) == ("plan", "answer")


def test_an_unclosed_block_at_the_end_stays_reasoning() -> None:
    assert _run(ReasoningSplitter(THINK), ["<think>still thinking"]) == ("still thinking", "")


def test_a_prompt_ending_inside_an_open_think_block_is_detected() -> None:
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n", THINK)
    assert not prompt_opens_thinking("<think>\n\n</think>\n\n", THINK)
    assert not prompt_opens_thinking("<|im_start|>assistant\n", THINK)


GRANITE_ANSWER = ("<response>", "</response>")


def test_granite_response_tags_are_dropped_from_the_content() -> None:
    splitter = ReasoningSplitter(THINK, answer=GRANITE_ANSWER)
    text = "<think>1 plus 1 is 2.</think>\n<response>It is 2.</response>"

    assert _run(splitter, [text]) == ("1 plus 1 is 2.", "It is 2.")


def test_granite_tags_split_across_every_character_never_reach_either_channel() -> None:
    splitter = ReasoningSplitter(THINK, answer=GRANITE_ANSWER)
    text = "<think>sum</think><response>2</response>"

    assert _run(splitter, list(text)) == ("sum", "2")


def test_an_answer_without_response_tags_is_still_content() -> None:
    splitter = ReasoningSplitter(THINK, answer=GRANITE_ANSWER)

    assert _run(splitter, list("It is 2. <respite> <b>")) == ("", "It is 2. <respite> <b>")


def test_a_response_tag_inside_the_thinking_stays_reasoning() -> None:
    splitter = ReasoningSplitter(THINK, answer=GRANITE_ANSWER)
    text = "<think>I will write <response> next.</think><response>Done.</response>"

    assert _run(splitter, [text]) == ("I will write <response> next.", "Done.")
