"""The rerank surface: `POST /v1/rerank` and `/rerank`, the shape llama-server, vLLM, Jina and
Cohere share."""
