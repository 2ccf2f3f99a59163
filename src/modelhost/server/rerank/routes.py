"""`POST /v1/rerank` and `/rerank`: a query scored against documents by a cross-encoder.

The leasing middleware has leased the reranker the body's `model` names (an unknown name is a
404, a model that does not rerank a 400); a worker serving one reranker answers with its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from modelhost.inference.encoder_ids import not_a_reranker
from modelhost.server.exchange import answer_json
from modelhost.server.http import STAGE_KEY, RequestLog
from modelhost.server.openai.wire import new_id, openai_error
from modelhost.server.rerank.wire import parse_rerank, rerank_answer

if TYPE_CHECKING:
    from modelhost.inference.rerank import RerankStage

ROUTE = "POST /v1/rerank"


async def create_rerank(request: Request) -> Response:
    log = RequestLog(new_id("rerank"), ROUTE)

    async def rerank(body: dict[str, Any]) -> dict[str, Any]:
        stage = reranker_for(request, body.get("model"))
        asked = parse_rerank(body)
        result = await stage.rerank(asked.query, asked.documents, asked.top_n)
        return rerank_answer(log.request_id, stage.model_id, asked, result)

    return await answer_json(request, log, openai_error, rerank)


def reranker_for(request: Request, model: object) -> RerankStage:
    """The reranker that answers: the one leased for this request, or the one a single-model
    app serves; any other model is a 400."""
    from modelhost.inference.rerank import RerankStage

    served = request.scope.get(STAGE_KEY) or getattr(request.app.state, "stage", None)
    if isinstance(served, RerankStage):
        return served
    raise not_a_reranker(getattr(served, "model_id", None) or str(model))
