"""Operational metrics: Prometheus at /metrics, from the database at scrape time and from outbox events."""
