"""A tool conversation reaches Gemma 3 in its native tool_code / tool_output form."""

from __future__ import annotations

import pytest

from modelhost.inference.contracts import ChatPrompt, InferenceRequest
from modelhost.inference.prompt import prompt_ids_for
from modelhost.models.loaded import LoadedModel

pytestmark = pytest.mark.slow

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
MESSAGES = (
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
)


def test_a_gemma_prompt_carries_the_call_and_its_result_as_fences(gemma3: LoadedModel) -> None:
    request = InferenceRequest("r1", "chat", ChatPrompt(messages=MESSAGES, tools=(TOOL,)))

    rendered = gemma3.tokenizer.decode(prompt_ids_for(gemma3, request), False)

    assert '"name": "get_weather"' in rendered
    assert (
        "<start_of_turn>model\n```tool_code\nget_weather(city='Paris')\n```<end_of_turn>"
        in rendered
    )
    assert (
        "<start_of_turn>user\n```tool_output\nsunny\n```<end_of_turn>\n<start_of_turn>model\n"
        in rendered
    )
    assert "<start_of_turn>tool" not in rendered
