"""End-to-end tests: a real daphne orchestrator, real HTTP and real SSE streams."""
