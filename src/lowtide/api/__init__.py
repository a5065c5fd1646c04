"""The REST API (FastAPI; OpenAPI at /docs): jobs, logs, checkpoints, the pool, tokens, metrics."""
