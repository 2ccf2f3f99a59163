"""Batched sampling: logits processors, then the sampling knobs, per-row seeds and logprobs.

`sample` runs once per engine step over every live row. Each stage is one tensor operation over the
rows that need it; the only per-row Python work is building small index lists and drawing one
uniform number per sampled row from that row's own generator.

Per row, in order: logit_bias (added); repetition_penalty over the distinct prompt and output
tokens (HF convention: positive logits divided by the penalty, negative ones multiplied); presence
and frequency penalties over output tokens only (OpenAI convention); then greedy rows take the
argmax and the others go through temperature, top_k, top_p and min_p before the draw. Rows with a
grammar have every token it forbids masked to -inf after the penalties, before either path, and
a grammar row that must start closing its value to stay within max_tokens takes the closing
token instead of the drawn one (`grammar_close`).
Logprobs describe the raw model distribution, before any of that. A row with `readout_token_ids`
gets the raw logprobs of exactly those ids, in that order, as its alternatives (typed decisions).

Reproducibility: a row's draw depends only on its own logits and its own generator, never on which
rows share the batch (on CPU bit for bit; CUDA reductions may round differently with the batch
shape, which matters only when a uniform lands within rounding of a CDF step). The draw inverts
the row's CDF with one float64 uniform from a CPU generator, so a seed gives the same uniform
stream on every device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from modelhost.engine.sampling.grammar_masks import GrammarState, apply_masks
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.kernels import native

# Top-p first looks for the nucleus among this many best tokens, then among more, and only sorts a
# whole row when a very flat distribution spreads the mass wider: a full sort of a 50k vocabulary
# costs milliseconds per row on a CPU, a top-256 a fraction of that.
_TOP_P_CANDIDATES = (256, 4096)
_SEED_MASK = (1 << 64) - 1


@dataclass(slots=True)
class RowSamplingState:
    """Everything the sampler needs about one live sequence; created when it is submitted.

    The engine appends each sampled token to `output_ids` itself. `prompt_ids` must not change after
    the first `sample` call: its tensor form is cached for the repetition penalty.
    """

    params: SamplingParams
    generator: torch.Generator | None  # None when greedy
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None
    _prompt_tensor: torch.Tensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: list[int]) -> RowSamplingState:
        generator = None
        if not params.greedy:
            generator = torch.Generator()
            if params.seed is None:
                generator.seed()
            else:
                # OpenAI seeds are any integer; torch wants one that fits in 64 bits.
                generator.manual_seed(params.seed & _SEED_MASK)
        grammar = None
        if params.grammar is not None:
            grammar = GrammarState(params.grammar, params.grammar_close)
        return cls(params=params, generator=generator, prompt_ids=prompt_ids, grammar=grammar)

    def prompt_tensor(self) -> torch.Tensor:
        if self._prompt_tensor is None:
            self._prompt_tensor = torch.tensor(self.prompt_ids, dtype=torch.long)
        return self._prompt_tensor


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the raw model distribution; None when logprobs are off
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


def sample(logits: torch.Tensor, rows: Sequence[RowSamplingState]) -> list[SampledToken]:
    """Pick one token per row of `logits` (float32 [R, V], row i belongs to `rows[i]`).

    `logits` is modified in place (bias, penalties, temperature, filters) to save copies; callers
    must not read it afterwards.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(rows)} rows")
    if not rows:
        return []
    if logits.dtype != torch.float32:
        logits = logits.float()

    logprob_rows = [
        i
        for i, row in enumerate(rows)
        if row.params.logprobs is not None or row.params.readout_token_ids
    ]
    raw_logprobs = None
    if logprob_rows:
        # log_softmax allocates, so the in-place processing below cannot reach these values.
        raw_logprobs = torch.log_softmax(_take_rows(logits, logprob_rows), dim=-1)

    _apply_logit_bias(logits, rows)
    _apply_penalties(logits, rows)
    if any(row.grammar is not None for row in rows):
        apply_masks(logits, [row.grammar for row in rows])

    sampled_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not sampled_rows:
        token_ids = _argmax(logits)
    elif len(sampled_rows) == len(rows):
        token_ids = _draw(logits, rows)
    else:
        token_ids = _argmax(logits)
        index = _index(sampled_rows, logits.device)
        drawn = _draw(logits.index_select(0, index), [rows[i] for i in sampled_rows])
        token_ids.index_copy_(0, index, drawn)

    chosen = token_ids.tolist()
    if _steer(chosen, rows):
        token_ids = torch.tensor(chosen, dtype=token_ids.dtype, device=token_ids.device)
    results = [SampledToken(token_id) for token_id in chosen]
    if raw_logprobs is not None:
        _fill_logprobs(results, raw_logprobs, logprob_rows, token_ids, rows)
    return results


def probabilities(logits: torch.Tensor, rows: Sequence[RowSamplingState]) -> torch.Tensor:
    """The distribution `sample` draws each sampling (non-greedy) row's token from: after
    logit_bias, penalties, grammar masks, temperature, top_k, top_p and min_p. Speculative
    sampling (speculative_sampling.py) weighs a draft's guesses against it. `logits` is
    modified in place."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    _apply_logit_bias(logits, rows)
    _apply_penalties(logits, rows)
    if any(row.grammar is not None for row in rows):
        apply_masks(logits, [row.grammar for row in rows])
    logits.div_(_column([row.params.temperature or 1.0 for row in rows], logits.device))
    _filter(logits, rows)
    return torch.softmax(logits, dim=-1)


def chosen_token(raw_logits: torch.Tensor, token_id: int, row: RowSamplingState) -> SampledToken:
    """`token_id` as `sample` reports a token it chose for `row` from `raw_logits` ([1, V],
    unprocessed): with the raw model's logprobs when the row asks for them."""
    result = SampledToken(token_id)
    if row.params.logprobs is not None or row.params.readout_token_ids:
        raw_logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
        chosen = torch.tensor([token_id], dtype=torch.long, device=raw_logits.device)
        _fill_logprobs([result], raw_logprobs, [0], chosen, [row])
    return result


def _steer(chosen: list[int], rows: Sequence[RowSamplingState]) -> bool:
    """Let each closing grammar row replace its drawn token (in place) when keeping it would
    leave the row's value unclosable within its budget; whether any row did."""
    changed = False
    for i, row in enumerate(rows):
        grammar = row.grammar
        if grammar is not None and grammar.closer is not None:
            remaining = row.params.max_tokens - len(row.output_ids)
            token_id = grammar.steer(chosen[i], remaining)
            if token_id != chosen[i]:
                chosen[i] = token_id
                changed = True
    return changed


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[RowSamplingState]) -> None:
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias.items():
            # An id outside this model's vocabulary cannot be sampled anyway; failing here would
            # take down every row of the step.
            if 0 <= token_id < vocab_size:
                row_index.append(i)
                token_index.append(token_id)
                values.append(bias)
    if values:
        device = logits.device
        logits.index_put_(
            (_index(row_index, device), _index(token_index, device)),
            torch.tensor(values, dtype=logits.dtype, device=device),
            accumulate=True,
        )


def _apply_penalties(logits: torch.Tensor, rows: Sequence[RowSamplingState]) -> None:
    """Penalise in place, touching only the logits of tokens in each row's history.

    A token repeated in a history appears several times in the index grid; every copy computes
    the same new value, so the duplicate writes agree.
    """
    device = logits.device
    repeated = [
        i
        for i, row in enumerate(rows)
        if row.params.repetition_penalty != 1.0 and (row.prompt_ids or row.output_ids)
    ]
    if repeated:
        histories = [
            torch.cat((rows[i].prompt_tensor(), torch.tensor(rows[i].output_ids, dtype=torch.long)))
            for i in repeated
        ]
        row_index, token_index, _ = _token_grid(repeated, histories, device)
        values = logits[row_index, token_index]
        penalty = _column([rows[i].params.repetition_penalty for i in repeated], device)
        logits[row_index, token_index] = torch.where(values > 0, values / penalty, values * penalty)

    counted = [
        i
        for i, row in enumerate(rows)
        if row.output_ids and (row.params.presence_penalty or row.params.frequency_penalty)
    ]
    if counted:
        outputs = [torch.tensor(rows[i].output_ids, dtype=torch.long) for i in counted]
        row_index, token_index, is_token = _token_grid(counted, outputs, device)
        frequency = _column([rows[i].params.frequency_penalty for i in counted], device)
        # Accumulating once per occurrence subtracts frequency * count; padding adds nothing.
        logits.index_put_((row_index, token_index), -frequency * is_token, accumulate=True)
        presence = _column([rows[i].params.presence_penalty for i in counted], device)
        logits[row_index, token_index] = logits[row_index, token_index] - presence


def _token_grid(
    row_ids: list[int], sequences: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row and token indices for non-empty id sequences of different lengths, padded into a grid.

    Padding repeats the row's first token rather than pointing outside the vocabulary, so that
    gathers and plain writes through the grid stay in bounds and harmless; the third tensor marks
    the real entries for writes that accumulate.
    """
    padded = pad_sequence(sequences, batch_first=True, padding_value=-1)
    is_token = padded >= 0
    token_index = torch.where(is_token, padded, padded[:, :1])
    row_index = torch.tensor(row_ids, dtype=torch.long).unsqueeze(1).expand_as(token_index)
    return row_index.to(device), token_index.to(device), is_token.to(device)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first best token (torch.argmax; natively ~10x faster on a large vocabulary)."""
    kernels = native.kernels()
    if kernels is not None and native.readable(logits):
        return kernels.choose_tokens(logits, None)
    return logits.argmax(dim=-1)


def _draw(logits: torch.Tensor, rows: Sequence[RowSamplingState]) -> torch.Tensor:
    """Sample one token per row of `logits` (modified in place); every row has a generator."""
    device = logits.device
    temperatures = _column([row.params.temperature for row in rows], device)
    # Inverse-CDF draw: one uniform per row whatever the vocabulary size, where exponential-noise
    # sampling would draw V of them (tens of ms per step on a CPU). softmax, unlike a bare exp(),
    # stays fast on the -inf the filters leave behind.
    uniforms = torch.tensor(
        [torch.rand((), dtype=torch.float64, generator=row.generator).item() for row in rows],
        dtype=torch.float32,
        device=device,
    )
    kernels = native.kernels()
    native_draw = kernels is not None and native.readable(logits)
    if (
        kernels is not None
        and native_draw
        and not any(_filters(row.params, logits.shape[1]) for row in rows)
    ):
        # The same draw in one native pass per row (~10x faster on a 262,144-token vocabulary),
        # the temperature applied inside it: one pass over the logits fewer.
        return kernels.choose_tokens(logits, uniforms, temperatures.view(-1))
    logits.div_(temperatures)
    _filter(logits, rows)
    if kernels is not None and native_draw:
        return kernels.choose_tokens(logits, uniforms)
    cdf = torch.softmax(logits, dim=-1).cumsum_(dim=-1)
    total = cdf[:, -1]
    # Keep the target strictly below the total so rounding can never run past the last token.
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    token_ids = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return token_ids.clamp_(max=logits.shape[1] - 1)


def _filters(params: SamplingParams, vocab_size: int) -> bool:
    """Whether `_filter` cuts anything from a row with these parameters."""
    return 0 < params.top_k < vocab_size or params.top_p < 1.0 or params.min_p > 0


def _filter(logits: torch.Tensor, rows: Sequence[RowSamplingState]) -> None:
    """Apply top_k, then top_p, then min_p in place: -inf below a per-row threshold logit.

    A threshold keeps every token tied with the cut-off, as HF's warpers do, which also keeps the
    result independent of how a sort happens to order ties.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    neg_inf = float("-inf")
    threshold: torch.Tensor | None = None  # [rows, 1]; -inf where a row keeps everything

    top_k_rows = [j for j, row in enumerate(rows) if 0 < row.params.top_k < vocab_size]
    if top_k_rows:
        ks = [rows[j].params.top_k for j in top_k_rows]
        best = torch.topk(_take_rows(logits, top_k_rows), max(ks), dim=-1).values
        threshold = logits.new_full((len(rows), 1), neg_inf)
        threshold[_index(top_k_rows, device)] = best.gather(1, _index(ks, device).sub_(1)[:, None])

    top_p_rows = [j for j, row in enumerate(rows) if row.params.top_p < 1.0]
    if top_p_rows:
        if threshold is not None:
            # top_p measures mass within what top_k kept.
            logits.masked_fill_(logits < threshold, neg_inf)
        else:
            threshold = logits.new_full((len(rows), 1), neg_inf)
        top_p = torch.tensor([rows[j].params.top_p for j in top_p_rows], device=device)
        cutoffs = _top_p_cutoffs(_take_rows(logits, top_p_rows), top_p)
        threshold[_index(top_p_rows, device)] = cutoffs.unsqueeze(1)

    min_p = [row.params.min_p for row in rows]
    if any(min_p):
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf keeps all.
        log_min_p = _column([math.log(p) if p > 0 else neg_inf for p in min_p], device)
        relative = logits.amax(dim=-1, keepdim=True) + log_min_p
        threshold = relative if threshold is None else torch.maximum(threshold, relative)

    if threshold is not None:
        logits.masked_fill_(logits < threshold, neg_inf)


def _top_p_cutoffs(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The lowest logit inside each row's nucleus: the fewest best tokens whose mass reaches p."""
    num_rows, vocab_size = logits.shape
    probs = torch.softmax(logits, dim=-1)
    cutoffs = torch.empty(num_rows, dtype=logits.dtype, device=logits.device)
    pending = torch.arange(num_rows, device=logits.device)
    for num_candidates in (*_TOP_P_CANDIDATES, vocab_size):
        k = min(num_candidates, vocab_size)
        whole = pending.numel() == num_rows
        best = torch.topk(logits if whole else logits[pending], k, dim=-1)
        best_probs = (probs if whole else probs[pending]).gather(1, best.indices)
        cumulative = best_probs.cumsum_(dim=-1)
        p = top_p[pending].unsqueeze(1)
        # The nucleus ends at the first token whose running mass reaches p; it always has one.
        num_kept = ((cumulative < p).sum(dim=-1, keepdim=True) + 1).clamp_(max=k)
        covered = cumulative[:, -1] >= p.squeeze(1)
        if k == vocab_size:
            covered.fill_(True)
        cutoffs[pending[covered]] = best.values.gather(1, num_kept - 1).squeeze(1)[covered]
        pending = pending[~covered]
        if pending.numel() == 0:
            break
    return cutoffs


def _fill_logprobs(
    results: list[SampledToken],
    raw_logprobs: torch.Tensor,
    logprob_rows: list[int],
    token_ids: torch.Tensor,
    rows: Sequence[RowSamplingState],
) -> None:
    chosen_ids = token_ids.index_select(0, _index(logprob_rows, token_ids.device))
    chosen = raw_logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    counts = [rows[i].params.logprobs or 0 for i in logprob_rows]
    top_values: list[list[float]] = [[] for _ in logprob_rows]
    top_ids: list[list[int]] = [[] for _ in logprob_rows]
    if max(counts):
        top = torch.topk(raw_logprobs, max(counts), dim=-1)
        top_values = top.values.tolist()
        top_ids = top.indices.tolist()
    for j, i in enumerate(logprob_rows):
        result = results[i]
        result.logprob = chosen[j]
        readout = rows[i].params.readout_token_ids
        if readout:
            # Ids outside this model's vocabulary read as impossible rather than failing the step.
            vocab_size = raw_logprobs.shape[1]
            known = [t for t in readout if t < vocab_size]
            values = dict(zip(known, raw_logprobs[j, known].tolist(), strict=True))
            result.top_ids = list(readout)
            result.top_logprobs = [values.get(t, float("-inf")) for t in readout]
        else:
            result.top_ids = top_ids[j][: counts[j]]
            result.top_logprobs = top_values[j][: counts[j]]


def _take_rows(logits: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
    """The given rows; the tensor itself (no copy) when that is all of them, in order."""
    if len(row_ids) == logits.shape[0]:
        return logits
    return logits.index_select(0, _index(row_ids, logits.device))


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
