"""The admin index's "Recent actions" (issue 32.9): the newest audit rows, everyone's, linked to their
targets; not Django's LogEntry; only for those who may read the audit log."""

import pytest

from audit.tests.factories import AuditEventFactory
from job_queue.tests.factories import JobFactory
from workers.tests.factories import UserFactory
from workers.tests.support import admin_url

pytestmark = pytest.mark.django_db


def _sidebar(response):
    html = response.content.decode()
    start = html.find('id="recent-actions-module"')
    return html[start : html.find("</div>", start)] if start >= 0 else None


def test_recent_actions_are_the_newest_audit_rows(admin_client):
    job = JobFactory()
    AuditEventFactory(action="worker.created", actor_name="someone-else")
    AuditEventFactory(action="job.cancel_requested", target_type="job", target_id=job.pk, success=False)

    sidebar = _sidebar(admin_client.get("/admin/"))

    assert sidebar is not None and "The audit log, newest first" in sidebar
    assert sidebar.index("job.cancel_requested") < sidebar.index("worker.created")  # newest first
    assert "someone-else" in sidebar and "refused" in sidebar
    assert f'<a href="{admin_url(job)}">job:{job.pk}</a>' in sidebar
    assert 'href="/admin/audit/auditevent/"' in sidebar
    assert "My actions" not in sidebar and "None available" not in sidebar


def test_no_recent_actions_without_the_audit_permission(client):
    client.force_login(UserFactory(is_staff=True, permissions=["queue.view_job"]))
    AuditEventFactory(action="worker.created")
    response = client.get("/admin/")
    assert response.status_code == 200
    assert _sidebar(response) is None and "worker.created" not in response.content.decode()
