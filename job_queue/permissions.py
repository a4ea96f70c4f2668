"""The permissions of operator actions on jobs, one name each (checked by ``common.permissions``)."""

VIEW_JOBS = "queue.view_job"
SUBMIT_JOBS = "queue.submit_job"
CANCEL_JOBS = "queue.cancel_job"
RETRY_JOBS = "queue.retry_job"
