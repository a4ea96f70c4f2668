"""All SSE: worker streams, the operators' change feed, delivery of the apps' outbox events, Redis fan-out."""
