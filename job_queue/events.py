"""What the job queue announces through ``common.outbox`` once a transaction commits (``observability`` counts them;
``webhooks`` stages its deliveries of status changes in the changing transaction).

Events for a worker's own stream (``job_submit``, ``job_cancel``) go through ``workers.events``.
"""

DISPATCHED = "job.dispatched"  # payload: job_id, attempt_number, submitted_at, dispatched_at
ACKNOWLEDGED = "job.acknowledged"  # payload: dispatched_at, started_at
REQUEUED = "job.requeued"  # payload: count, retry_spent
RETRIES_EXHAUSTED = "job.retries_exhausted"  # payload: count
STATUS_CHANGED = "job.status_changed"  # payload: changes, [(job_id, from_status, to_status)]; at (when)
