"""Every write of webhooks: create, change, delete, redeliver; and the senders' claim and record of deliveries."""

import random
import secrets as secrets_module
from datetime import timedelta
from urllib.parse import urlsplit

from django.db import transaction
from django.utils import timezone

from audit import actions
from audit.services import audit_record, audited_atomic
from common.errors import Conflict, InvalidInput, NotFound
from common.inputs import text_problem
from common.updates import update_rows

from .addresses import AddressRefused, checked_addresses, url_problem
from .models import (
    EVENTS,
    SECRET_MAX_CHARS,
    SECRET_MIN_CHARS,
    URL_MAX_CHARS,
    Delivery,
    DeliveryAttempt,
    DeliveryStatus,
    Webhook,
    WebhookFormat,
)
from .selectors import deliveries_due, forget_webhooks_read

LEASE = timedelta(seconds=30)  # an attempt claimed and not recorded by then (its sender died) is due again
BACKOFF_FIRST_S = 10.0  # the first retry 10-15 s after the first attempt
BACKOFF_MAX_S = 3600.0  # then doubling, up to an hour between attempts
RETRIED_STATUS = frozenset({408, 429})  # besides 5xx


def _invalid(field, reason):
    return InvalidInput(f"{field}: {reason}", code="invalid", extra={"errors": {field: [reason]}})


def _check_url(url):
    if not isinstance(url, str) or not url or len(url) > URL_MAX_CHARS or text_problem(url):
        raise _invalid("url", f"must be an http(s) URL of at most {URL_MAX_CHARS} characters")
    problem = url_problem(url)
    if problem:
        raise _invalid("url", problem)
    try:
        checked_addresses(url)
    except AddressRefused as exc:
        raise _invalid("url", str(exc)) from None


def _check_events(events):
    unknown = [e for e in events if e not in EVENTS]
    if not events or unknown or len(set(events)) != len(events):
        raise _invalid("events", f"a non-empty list of distinct events among {', '.join(EVENTS)}")
    return [e for e in EVENTS if e in events]  # in a stable order


def _check_secret(secret):
    if not SECRET_MIN_CHARS <= len(secret) <= SECRET_MAX_CHARS or text_problem(secret):
        raise _invalid("secret", f"{SECRET_MIN_CHARS}-{SECRET_MAX_CHARS} characters")


def webhook_check(**fields):
    """Raise InvalidInput (naming the field) unless each of ``fields`` (url, events, secret) could be a webhook's."""
    if "url" in fields:
        _check_url(fields["url"])
    if "events" in fields:
        _check_events(fields["events"])
    if "secret" in fields:
        _check_secret(fields["secret"])


def _shown(hook, **more):
    """What the audit trail keeps of a webhook: never its secret, and of its URL only the host (a Slack URL is a key)."""
    return {"host": urlsplit(hook.url).hostname or "", "events": hook.events, "format": hook.format, "active": hook.active, **more}


def webhook_create(*, url, events, actor, secret=None, format=WebhookFormat.JSON, active=True):
    """Create a webhook; return it. Raise InvalidInput (naming the field) for a bad URL, events or secret.

    A Slack-format webhook needs no secret (Slack checks none); one is made up for it.
    """
    _check_url(url)
    events = _check_events(events)
    if secret is None:
        if format != WebhookFormat.SLACK:
            raise _invalid("secret", "required: it signs every delivery")
        secret = secrets_module.token_urlsafe(32)
    _check_secret(secret)
    with audited_atomic():
        hook = Webhook.objects.create(url=url, events=events, secret=secret, format=format, active=active, created_by_id=actor.user_id)
        audit_record(actor=actor, action=actions.WEBHOOK_CREATED, target_type="webhook", target_id=hook.pk, details=_shown(hook))
        forget_webhooks_read()
    return hook


def webhook_update(*, webhook_id, actor, **changes):
    """Change ``changes`` (url, events, secret, format, active) of a webhook; return it. Raise NotFound, InvalidInput."""
    if "url" in changes:
        _check_url(changes["url"])
    if "events" in changes:
        changes["events"] = _check_events(changes["events"])
    if "secret" in changes:
        _check_secret(changes["secret"])
    with audited_atomic():
        hook = Webhook.objects.select_for_update().filter(pk=webhook_id).first()
        if hook is None:
            raise NotFound(f"webhook {webhook_id} does not exist")
        changes = {name: value for name, value in changes.items() if getattr(hook, name) != value}
        if not changes:
            return hook  # nothing to change: nothing written, nothing audited
        for name, value in changes.items():
            setattr(hook, name, value)
        hook.save()
        shown = _shown(hook, changed=sorted(changes))
        audit_record(actor=actor, action=actions.WEBHOOK_UPDATED, target_type="webhook", target_id=hook.pk, details=shown)
        forget_webhooks_read()
    return hook


def webhook_delete(*, webhook_id, actor):
    """Delete a webhook and its deliveries (pending ones are not sent). Raise NotFound."""
    with audited_atomic():
        hook = Webhook.objects.select_for_update().filter(pk=webhook_id).first()
        if hook is None:
            raise NotFound(f"webhook {webhook_id} does not exist")
        audit_record(actor=actor, action=actions.WEBHOOK_DELETED, target_type="webhook", target_id=hook.pk, details=_shown(hook))
        hook.delete()
        forget_webhooks_read()


def delivery_redeliver(*, delivery_id, actor, webhook_id=None, now=None):
    """Send an ended (delivered or failed) delivery again, with the same id and body, retried as a new one. Return it.

    Raise NotFound, or Conflict if it is still pending (it is being sent or retried already).
    """
    now = now or timezone.now()
    with audited_atomic():
        found = Delivery.objects.select_for_update().filter(delivery_id=delivery_id)
        if webhook_id is not None:
            found = found.filter(webhook_id=webhook_id)
        delivery = found.first()
        if delivery is None:
            raise NotFound(f"delivery {delivery_id} does not exist")
        if delivery.status == DeliveryStatus.PENDING:
            raise Conflict(f"delivery {delivery_id} is pending already: it is being sent or retried", code="delivery_pending")
        previous = delivery.status
        Delivery.objects.filter(pk=delivery.pk).update(
            status=DeliveryStatus.PENDING, next_attempt_at=now, retry_until=now + (delivery.retry_until - delivery.occurred_at), finished_at=None
        )
        audit_record(
            actor=actor,
            action=actions.WEBHOOK_REDELIVERED,
            target_type="webhook",
            target_id=delivery.webhook_id,
            details={"delivery": delivery.delivery_id, "event": delivery.event, "was": previous},
        )
    from .sender import SENDER

    transaction.on_commit(SENDER.wake, robust=True)
    delivery.refresh_from_db()
    return delivery


# --- the senders' side ------------------------------------------------------------------------------


def deliveries_claim(*, limit, now=None):
    """Claim up to ``limit`` due deliveries for one sender; return them (with their webhooks).

    Each is leased until ``now + LEASE`` (its ``next_attempt_at``): no other sender takes it meanwhile, and
    its result is recorded only while the lease holds (``deliveries_record``). Several senders at once skip
    each other's rows (``SKIP LOCKED`` on PostgreSQL; SQLite has one writer). The transaction ends before
    anything is sent.
    """
    now = now or timezone.now()
    lease = now + LEASE
    with transaction.atomic():
        seqs = list(deliveries_due(now=now).select_for_update(skip_locked=True).values_list("seq", flat=True)[:limit])
        if not seqs:
            return []
        Delivery.objects.filter(seq__in=seqs, status=DeliveryStatus.PENDING, next_attempt_at__lte=now).update(next_attempt_at=lease)
    claimed = list(Delivery.objects.filter(seq__in=seqs, next_attempt_at=lease).select_related("webhook").order_by("seq"))
    return claimed


def retry_delay(attempts, *, retry_after=None, rand=random.random):
    """Return the seconds to wait before the next attempt after ``attempts`` failed ones: 10-15 s, then doubling up to
    an hour; a receiver's ``Retry-After`` is honoured up to that hour."""
    delay = min(BACKOFF_FIRST_S * 2 ** max(attempts - 1, 0), BACKOFF_MAX_S) * (1 + rand() / 2)
    if retry_after is not None:
        delay = max(delay, min(retry_after, BACKOFF_MAX_S))
    return min(delay, BACKOFF_MAX_S * 1.5)


def outcome(answer):
    """Return what ``answer`` makes of a delivery: delivered, retry or failed (a refusal not to be retried)."""
    code = answer.status_code
    if code is not None and 200 <= code < 300:
        return DeliveryStatus.DELIVERED
    if code is None:
        return DeliveryStatus.FAILED if answer.refused else "retry"
    return "retry" if code >= 500 or code in RETRIED_STATUS else DeliveryStatus.FAILED


def deliveries_record(results, *, now=None, rand=random.random):
    """Record each ``(claimed delivery, started_at, answer)``: one attempt row each, and the delivery delivered,
    failed, or due again after its backoff (failed once its retry window is over). One INSERT and one UPDATE for
    them all; a delivery whose lease another sender has taken over since is left to it. Return the outcomes."""
    now = now or timezone.now()
    attempts, changes, expect, outcomes = [], {}, {}, []
    for delivery, started_at, answer in results:
        number = delivery.attempts + 1
        result = outcome(answer)
        if result == "retry" and now >= delivery.retry_until:
            result = DeliveryStatus.FAILED
        error = answer.error[:500] if answer.error else ""
        attempts.append(
            DeliveryAttempt(
                delivery_id=delivery.pk, number=number, started_at=started_at, duration_ms=answer.duration_ms,
                status_code=answer.status_code, error=error, outcome=result,
            )  # fmt: skip
        )
        change = {"attempts": number, "last_status_code": answer.status_code, "last_error": error}
        if result == "retry":
            change["next_attempt_at"] = now + timedelta(seconds=retry_delay(number, retry_after=answer.retry_after, rand=rand))
        else:
            change.update(status=result, next_attempt_at=None, finished_at=now)
        changes[delivery.pk] = change
        expect[delivery.pk] = {"status": DeliveryStatus.PENDING, "next_attempt_at": delivery.next_attempt_at}
        outcomes.append(result)
    with transaction.atomic():
        # A delivery deleted meanwhile (with its webhook) gets no attempt row; the others are held until the commit.
        alive = set(Delivery.objects.select_for_update().filter(pk__in=list(changes)).values_list("pk", flat=True))
        DeliveryAttempt.objects.bulk_create([a for a in attempts if a.delivery_id in alive])
        update_rows(Delivery.objects, {pk: c for pk, c in changes.items() if pk in alive}, expect=expect)
    return outcomes
