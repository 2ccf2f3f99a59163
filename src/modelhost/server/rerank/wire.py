"""The rerank wire: a request's fields read and checked, an answer shaped.

Request: `model`, `query` (a string), `documents` (strings or `{"text": ...}` objects),
`top_n` (a positive integer; more than there are documents answers them all) and
`return_documents` (default false, Cohere's default; Jina's is true, so clients that want the
text send it). Answer: `id`, `model`, `results` best first, each `index` (the document's place
in the request), `relevance_score` and, when asked, `document: {"text"}`; `usage`. Errors are
OpenAI's shape, each 400 naming its field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelhost.inference.contracts import InvalidRequest
from modelhost.inference.rerank import RerankResult

MAX_DOCUMENTS = 1000  # Cohere's and Jina's cap on one request's documents
DOCUMENTS_SHAPE = '`documents` must be a non-empty array of strings or of {"text": string}'


@dataclass(frozen=True, slots=True)
class RerankQuery:
    query: str
    documents: list[str]
    top_n: int | None
    return_documents: bool


def parse_rerank(body: dict[str, Any]) -> RerankQuery:
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise InvalidRequest("`query` must be a non-empty string", param="query")
    top_n = body.get("top_n")
    if top_n is not None and (type(top_n) is not int or top_n < 1):
        raise InvalidRequest("`top_n` must be a positive integer", param="top_n")
    return_documents = body.get("return_documents", False)
    if type(return_documents) is not bool:
        raise InvalidRequest("`return_documents` must be a boolean", param="return_documents")
    return RerankQuery(query, _documents(body.get("documents")), top_n, return_documents)


def _documents(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest(DOCUMENTS_SHAPE, param="documents")
    if len(value) > MAX_DOCUMENTS:
        message = f"`documents` has {len(value)} items; at most {MAX_DOCUMENTS}"
        raise InvalidRequest(message, param="documents")
    texts = []
    for index, item in enumerate(value):
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str):
            message = f"documents[{index}] must be a string or an object with a string `text`"
            raise InvalidRequest(message, param="documents")
        texts.append(text)
    return texts


def rerank_answer(
    request_id: str, model_id: str, asked: RerankQuery, result: RerankResult
) -> dict[str, Any]:
    results = []
    for ranked in result.ranked:
        row: dict[str, Any] = {"index": ranked.index, "relevance_score": ranked.score}
        if asked.return_documents:
            row["document"] = {"text": asked.documents[ranked.index]}
        results.append(row)
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"id": request_id, "model": model_id, "results": results, "usage": usage}
