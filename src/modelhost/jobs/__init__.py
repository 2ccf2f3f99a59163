"""Jobs: long work (benchmarks, evaluations, conversions) that outlives the request that started
it, recorded in SQLite, logged as NDJSON events and watched over SSE."""
