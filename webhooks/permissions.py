"""The permissions of operator actions on webhooks (checked by ``common.permissions``).

Webhooks are admin-level configuration: a URL can itself be a credential (Slack's), and a webhook sends job
and worker data outside the orchestrator. Of the shipped groups only ``admin`` holds these (migration 0002).
"""

VIEW_WEBHOOKS = "webhooks.view_webhook"  # and their deliveries
ADD_WEBHOOKS = "webhooks.add_webhook"
CHANGE_WEBHOOKS = "webhooks.change_webhook"
DELETE_WEBHOOKS = "webhooks.delete_webhook"
REDELIVER_WEBHOOKS = "webhooks.redeliver_webhook"
