"""Per-row output: token ids become safe text (detokenized, stop-matched) and typed events."""

from __future__ import annotations

from collections.abc import Callable

from modelhost.engine.events import EngineEvent, FinishReason, TokenLogprob, TopLogprob, Usage
from modelhost.engine.sampling.sampler import RowSamplingState, SampledToken
from modelhost.engine.sequence import Sequence
from modelhost.text.detokenizer import IncrementalDetokenizer
from modelhost.text.stop import StopMatcher
from modelhost.text.tokenizer import Tokenizer


class RowOutput:
    """What the engine keeps for one live row besides its Sequence: sampler state and text."""

    __slots__ = ("sampling", "detokenizer", "stops", "tokenizer", "post")

    def __init__(
        self,
        seq: Sequence,
        tokenizer: Tokenizer,
        post: Callable[[EngineEvent | BaseException], None],
    ) -> None:
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        self.sampling = RowSamplingState.create(seq.params, prompt)
        self.detokenizer = IncrementalDetokenizer(tokenizer.stream_decoder, prompt)
        self.stops = StopMatcher(seq.params.stop)
        self.tokenizer = tokenizer
        self.post = post  # delivers to the stream that owns the row, on its event loop

    def event_for(self, seq: Sequence, token: SampledToken) -> tuple[EngineEvent, str | None]:
        """The event for one newly sampled token, and the stop string it completed, if any."""
        self.sampling.output_ids.append(token.token_id)
        if self.sampling.grammar is not None:
            self.sampling.grammar.accept(token.token_id)
        text = ""
        if not (seq.is_finished and token.token_id in seq.eos_token_ids):
            text = self.detokenizer.add([token.token_id])
        emit, matched = self.stops.push(text)
        event = EngineEvent(text=emit, token_ids=[token.token_id])
        if token.logprob is not None:
            event.logprobs = [self._logprob(token)]
        return event, matched

    @property
    def grammar_done(self) -> bool:
        """The row's grammar admits no further token: the output is complete."""
        grammar = self.sampling.grammar
        return grammar is not None and grammar.is_terminated

    @property
    def grammar_complete(self) -> bool:
        """The row's grammar holds a whole value (a stop token may not have followed yet)."""
        grammar = self.sampling.grammar
        return grammar is not None and grammar.is_complete

    def finish(
        self, event: EngineEvent, seq: Sequence, reason: FinishReason, stop: str | None
    ) -> EngineEvent:
        """Release held-back text and close the stream's last event."""
        if reason == "length" and self.grammar_complete:
            reason = "stop"  # the budget ran out on a whole value: the answer is complete
        if stop is None and reason != "abort":
            event.text += self.stops.push(self.detokenizer.flush())[0] + self.stops.flush()
        event.finish_reason = reason
        event.stop_string = stop
        event.usage = Usage(
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_generated_tokens,
            cached_tokens=seq.num_cached_tokens,
            draft_tokens=seq.num_draft_tokens,
            accepted_draft_tokens=seq.num_accepted_tokens,
        )
        return event

    def _logprob(self, token: SampledToken) -> TokenLogprob:
        piece = self.tokenizer.id_to_piece
        top = tuple(
            TopLogprob(token_id, piece(token_id), logprob)
            for token_id, logprob in zip(token.top_ids, token.top_logprobs, strict=True)
        )
        return TokenLogprob(token.token_id, piece(token.token_id), float(token.logprob or 0), top)
