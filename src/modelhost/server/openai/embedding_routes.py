"""OpenAI embeddings: `POST /v1/embeddings`.

`input` is a string, an array of strings, an array of token ids or an array of such arrays;
`encoding_format` is `float` (default) or `base64` (little-endian float32, as OpenAI's clients
decode it); `dimensions` keeps the leading components, re-normalised. Served by the embedded
sentence encoders, named by `model`; a generative model answers 400 with the reference's message.
"""

from __future__ import annotations

import base64
import struct
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from modelhost.inference.contracts import InvalidRequest
from modelhost.inference.encoder_ids import EmbeddingInput, is_encoder, not_an_embedding_model
from modelhost.server.exchange import answer_json
from modelhost.server.http import STAGE_KEY, RequestLog, serving_stage
from modelhost.server.openai.wire import new_id, openai_error

if TYPE_CHECKING:
    from modelhost.inference.embeddings import EncoderStage

ROUTE = "POST /v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's own cap on one request's inputs
INPUT_SHAPE = "`input` must be a string, an array of strings, or an array of token arrays"


async def create_embeddings(request: Request) -> Response:
    log = RequestLog(new_id("emb"), ROUTE)

    async def embed(body: dict[str, Any]) -> dict[str, Any]:
        stage = await encoder_for(request, body.get("model"))
        inputs = parse_input(body.get("input"))
        base64_format = encoding_format(body.get("encoding_format"))
        dimensions = body.get("dimensions")
        if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
            raise InvalidRequest("dimensions must be a positive integer", param="dimensions")
        result = await stage.embed(inputs, dimensions)
        data = [
            {"object": "embedding", "index": index, "embedding": _encoded(vector, base64_format)}
            for index, vector in enumerate(result.vectors)
        ]
        usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
        return {"object": "list", "model": stage.model_id, "data": data, "usage": usage}

    return await answer_json(request, log, openai_error, embed)


async def encoder_for(request: Request, model: object) -> EncoderStage:
    """The encoder that answers: the one the leasing middleware leased, or (one model served
    without residency) an embedded encoder the body names; any other model is the 400 of the
    reference."""
    from modelhost.inference.embeddings import Encoders, EncoderStage  # PyTorch: where it runs

    leased = request.scope.get(STAGE_KEY)
    served = leased or getattr(request.app.state, "stage", None)  # a worker serves one model
    if isinstance(served, EncoderStage):
        return served
    if leased is None and is_encoder(model):
        state = request.app.state
        encoders: Encoders | None = getattr(state, "encoders", None)
        if encoders is None:
            encoders = state.encoders = Encoders()
        return await encoders.get(str(model))
    stage = serving_stage(request, model if isinstance(model, str) else None)
    raise not_an_embedding_model(stage.model_id)


def parse_input(value: Any) -> list[EmbeddingInput]:
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_token(v) for v in value):
        items = [value]  # one token array
    elif isinstance(value, list) and value:
        items = value
    else:
        raise InvalidRequest(INPUT_SHAPE, param="input")
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(f"`input` has {len(items)} items; at most {MAX_INPUTS}", "input")
    for index, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"input[{index}] must not be empty", param="input")
        elif not (isinstance(item, list) and item and all(_is_token(v) for v in item)):
            raise InvalidRequest(INPUT_SHAPE, param="input")
    return items


def encoding_format(value: Any) -> bool:
    """True for base64, False for float (the default)."""
    if value is None or value == "float":
        return False
    if value == "base64":
        return True
    raise InvalidRequest("encoding_format must be 'float' or 'base64'", param="encoding_format")


def _is_token(value: Any) -> bool:
    return type(value) is int


def _encoded(vector: list[float], as_base64: bool) -> list[float] | str:
    if not as_base64:
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
