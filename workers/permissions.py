"""The permissions of operator actions on workers and tokens, one name each (checked by ``common.permissions``)."""

VIEW_WORKERS = "workers.view_worker"
CREATE_WORKERS = "workers.add_worker"
DRAIN_WORKERS = "workers.drain_worker"  # and put a drained worker back in service (undrain)
CHANGE_WORKER_LABELS = "workers.change_worker"  # Django's own change permission: only labels change
ROTATE_WORKER_TOKENS = "workers.rotate_worker_token"
DELETE_WORKERS = "workers.delete_worker"
VIEW_TOKENS = "workers.view_token"
MANAGE_API_TOKENS = "workers.manage_api_tokens"
