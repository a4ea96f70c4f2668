"""The audit log in the Django admin: read-only for everyone, filterable, searchable by target, linked to its targets."""

from datetime import datetime, timezone

import pytest

from audit import actions
from audit.models import AuditEvent
from audit.tests.factories import AuditEventFactory
from job_queue.tests.factories import JobFactory
from workers.tests.factories import WorkerFactory
from workers.tests.support import action_names, admin_url, changelist_rows, listed

pytestmark = pytest.mark.django_db

LIST = "/admin/audit/auditevent/"


def test_the_audit_log_is_read_only_even_for_a_superuser(admin_client):
    signed_in = list(AuditEvent.objects.all())  # the admin's own account rows (created, signed in), newest first
    row = AuditEventFactory()

    listing = admin_client.get(LIST)
    assert listing.status_code == 200 and listed(listing) == [row, *signed_in]
    assert action_names(listing) == set()
    assert admin_client.get(LIST + "add/").status_code == 403
    assert admin_client.post(LIST + "add/", {"action": "forged"}).status_code == 403
    page = admin_client.get(admin_url(row))
    assert page.status_code == 200 and page.context["has_change_permission"] is False
    assert admin_client.post(admin_url(row), {"action": "forged"}).status_code == 403
    assert admin_client.get(admin_url(row, "delete")).status_code == 403
    assert admin_client.post(admin_url(row, "delete"), {"post": "yes"}).status_code == 403
    assert list(AuditEvent.objects.all()) == [row, *signed_in]


def test_staff_need_the_view_permission(staff_client):
    AuditEventFactory()

    assert staff_client().get(LIST).status_code == 403
    assert staff_client("audit.view_auditevent").get(LIST).status_code == 200


def test_the_filters_are_offered(admin_client):
    cl = admin_client.get(LIST).context["cl"]

    assert [getattr(spec, "field_path", None) or spec.parameter_name for spec in cl.filter_specs] == [
        "action", "actor_type", "success", "created_at", "target_type",
    ]  # fmt: skip
    actions_offered = [value for value, _ in cl.filter_specs[0].lookup_choices]
    assert actions.WORKER_CREATED in actions_offered and actions.JOB_RETRIED in actions_offered


@pytest.mark.parametrize(
    ("query", "wanted"),
    [
        ({"action": actions.WORKER_DELETED}, {"deleted"}),
        ({"actor_type__exact": "system"}, {"sweep"}),
        ({"success__exact": "0"}, {"refused"}),
        ({"target_type": "job"}, {"refused"}),
        ({"created_at__gte": "2024-03-01 00:00:00+00:00", "created_at__lt": "2024-03-02 00:00:00+00:00"}, {"sweep"}),
        ({"created_at__year": "2024", "created_at__month": "3", "created_at__day": "1"}, {"sweep"}),
        ({"created_at__year": "2024"}, {"sweep", "deleted"}),
    ],
)
def test_filters_keep_only_the_matching_rows(admin_client, query, wanted):
    rows = {
        "created": AuditEventFactory(action=actions.WORKER_CREATED),
        "deleted": AuditEventFactory(action=actions.WORKER_DELETED, created_at=datetime(2024, 5, 2, tzinfo=timezone.utc)),
        "sweep": AuditEventFactory(
            actor_type="system", actor_name="health-sweep", action=actions.WORKER_STATUS_CHANGED,
            created_at=datetime(2024, 3, 1, 12, tzinfo=timezone.utc),
        ),
        "refused": AuditEventFactory(action=actions.JOB_REPORT_REFUSED, target_type="job", target_id="j_1", success=False),
    }  # fmt: skip

    response = admin_client.get(LIST, query)

    assert response.status_code == 200
    assert {name for name, row in rows.items() if row in listed(response)} == wanted


def test_search_by_exact_target_id(admin_client):
    worker = WorkerFactory()
    mine = [AuditEventFactory(target_id=worker.pk), AuditEventFactory(target_id=worker.pk, action=actions.WORKER_DELETED)]
    AuditEventFactory(target_id=worker.pk + "0")  # an id it is a prefix of
    AuditEventFactory(target_id="w_other", details={"note": worker.pk})

    response = admin_client.get(LIST, {"q": worker.pk})

    assert set(listed(response)) == set(mine)
    assert listed(admin_client.get(LIST, {"q": worker.pk[:-1]})) == []


def test_the_target_column_links_to_the_worker_or_job(admin_client):
    signed_in = list(AuditEvent.objects.all())  # the admin's own account rows: user:<its id>, no link
    worker = WorkerFactory(id="w_22aabbccddee")
    job = JobFactory(id="j_40aabbccddee0011")
    on_worker = AuditEventFactory(target_type="worker", target_id=worker.pk)
    on_job = AuditEventFactory(target_type="job", target_id=job.pk, action=actions.JOB_SUBMITTED)
    on_user = AuditEventFactory(target_type="user", target_id="7", action=actions.API_TOKEN_CREATED)

    response = admin_client.get(LIST)

    cells = {event: row.split('<td class="field-target">')[1].split("</td>")[0] for event, row in changelist_rows(response).items()}
    assert cells == {
        on_worker: f'<a href="{admin_url(worker)}">worker:{worker.pk}</a>',
        on_job: f'<a href="{admin_url(job)}">job:{job.pk}</a>',
        on_user: "user:7",
        **{event: f"user:{event.target_id}" for event in signed_in},
    }
    assert admin_client.get(admin_url(worker)).context["original"] == worker
    assert admin_client.get(admin_url(job)).context["original"] == job



def test_the_filters_read_no_table_to_offer_their_choices(admin_client, django_assert_max_num_queries):
    AuditEventFactory.create_batch(3)

    with django_assert_max_num_queries(6) as captured:
        admin_client.get(LIST)

    assert not [q["sql"] for q in captured.captured_queries if "DISTINCT" in q["sql"].upper()]


@pytest.mark.postgres
def test_an_unfiltered_large_trail_on_postgresql_is_counted_by_estimate(postgres_url, monkeypatch, django_assert_num_queries):
    from django.db import connection

    from common import admin_kit as audit_admin

    assert connection.vendor == "postgresql"  # the test database follows DATABASE_URL
    AuditEventFactory.create_batch(5)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE audit_auditevent")
    monkeypatch.setattr(audit_admin, "ESTIMATE_COUNT_ABOVE", 2)

    unfiltered = audit_admin.EstimatedCountPaginator(AuditEvent.objects.all(), 100)
    filtered = audit_admin.EstimatedCountPaginator(AuditEvent.objects.filter(success=False), 100)

    with django_assert_num_queries(1) as captured:
        assert unfiltered.count == 5  # reltuples after ANALYZE
    assert "COUNT(" not in captured.captured_queries[0]["sql"].upper()
    assert filtered.count == 0  # filtered: exact


def test_search_by_target_id_is_exact_and_can_use_the_index(admin_client):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    row = AuditEventFactory(target_type="worker", target_id="w_abcdef123456")
    AuditEventFactory(target_type="worker", target_id="w_abcdef1234567")

    with CaptureQueriesContext(connection) as captured:
        response = admin_client.get(LIST, {"q": " w_abcdef123456 "})

    assert listed(response) == [row]
    assert listed(admin_client.get(LIST, {"q": "W_ABCDEF123456"})) == []
    assert not [q["sql"] for q in captured.captured_queries if "LIKE" in q["sql"].upper()]
