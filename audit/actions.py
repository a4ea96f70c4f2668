"""Audit action names: one dotted constant per kind of recorded change."""

WORKER_CREATED = "worker.created"
WORKER_DELETED = "worker.deleted"
WORKER_REGISTERED = "worker.registered"
WORKER_REGISTRATION_FAILED = "worker.registration_failed"
WORKER_STATUS_CHANGED = "worker.status_changed"
WORKER_DRAIN_REQUESTED = "worker.drain_requested"
WORKER_UNDRAINED = "worker.undrained"
WORKER_LABELS_CHANGED = "worker.labels_changed"
WORKER_DISCONNECTED = "worker.disconnected"
WORKER_TOKEN_ROTATED = "worker.token_rotated"
LOCAL_WORKER_PROVISIONED = "worker.local_provisioned"
WORKER_AGENT_REPLACED = "worker.agent_replaced"  # another agent took the worker over (its token): the one before is told

# Refused worker or operator tokens, bounded: per client address and window, the first refusal and
# the one that crossed the rate (workers.throttling).
AUTH_FAILED = "auth.failed"
AUTH_THROTTLED = "auth.throttled"
# A worker past the rate of refusals it provokes with its own valid token, or of registrations (workers.throttling):
# once per worker and window.
WORKER_THROTTLED = "worker.throttled"

API_TOKEN_CREATED = "api_token.created"
API_TOKEN_REVOKED = "api_token.revoked"

JOB_SUBMITTED = "job.submitted"
JOB_DISPATCHED = "job.dispatched"
JOB_STATUS_CHANGED = "job.status_changed"
JOB_CANCEL_REQUESTED = "job.cancel_requested"
JOB_RETRIED = "job.retried"
JOB_REQUEUED = "job.requeued"
JOB_REPORT_REFUSED = "job.report_refused"
JOB_COMPLETION_RECOVERED = "job.completion_recovered"

ARTIFACT_STORED = "artifact.stored"
ARTIFACTS_EXPIRED = "artifact.expired"
CHECKPOINT_COMPLETED = "checkpoint.completed"

CONFIG_CREATED = "config.created"
CONFIG_UPDATED = "config.updated"

# Webhooks (their secret is never recorded, of their URL only the host).
WEBHOOK_CREATED = "webhook.created"
WEBHOOK_UPDATED = "webhook.updated"
WEBHOOK_DELETED = "webhook.deleted"
WEBHOOK_REDELIVERED = "webhook.redelivery_requested"

# Teams and the limits on jobs (tenancy).
TEAM_CREATED = "team.created"
TEAM_MEMBERS_CHANGED = "team.members_changed"
TEAM_DELETED = "team.deleted"
LIMITS_CHANGED = "limits.changed"

# Accounts (workers.accounts): users, groups and their permissions, however changed (admin, shell, commands).
USER_CREATED = "user.created"
USER_DELETED = "user.deleted"
USER_ACTIVATED = "user.activated"
USER_DEACTIVATED = "user.deactivated"
USER_SUPERUSER_CHANGED = "user.superuser_changed"
USER_STAFF_CHANGED = "user.staff_changed"
USER_RENAMED = "user.renamed"
USER_PASSWORD_CHANGED = "user.password_changed"
USER_GROUPS_CHANGED = "user.groups_changed"
USER_PERMISSIONS_CHANGED = "user.permissions_changed"
GROUP_CREATED = "group.created"
GROUP_RENAMED = "group.renamed"
GROUP_DELETED = "group.deleted"
GROUP_PERMISSIONS_CHANGED = "group.permissions_changed"

# Sign-ins with a password (the admin's and the API's login pages): every success; failures bounded like
# refused tokens, per client address and window: the window's first failure and each address or username
# reaching the rate (workers.throttling).
AUTH_LOGIN = "auth.login"
AUTH_LOGIN_FAILED = "auth.login_failed"
AUTH_LOGIN_THROTTLED = "auth.login_throttled"
