"""The audit trail on a job's and a worker's admin page (issue 32.9): the newest few rows inline, and a link
to the audit list filtered to all of them, so a job with many rows keeps a short page."""

import re
from html import unescape

import pytest

from audit.tests.factories import AuditEventFactory
from job_queue.tests.factories import JobFactory
from workers.tests.support import admin_url, listed

pytestmark = pytest.mark.django_db


def _trail(response):
    html = response.content.decode()
    table = re.search(r'<table class="st-audit">.*?</table>\s*<p class="st-audit-more">(.*?)</p>', html, re.S)
    assert table, html[-2000:]
    return table.group(0), table.group(1)


def test_a_job_page_shows_its_newest_five_rows_and_links_to_all(admin_client):
    job = JobFactory()
    rows = [AuditEventFactory(target_type="job", target_id=job.pk, action=f"job.step_{n}") for n in range(12)]
    AuditEventFactory(target_type="worker", target_id=job.pk, action="worker.same_id")  # another kind of target

    table, more = _trail(admin_client.get(admin_url(job)))

    assert re.findall(r"job\.step_\d+", table) == [f"job.step_{n}" for n in (11, 10, 9, 8, 7)]
    assert "Showing the newest 5 of 12" in more and "all 12 audit rows for " + job.pk in more
    link = unescape(re.search(r'href="([^"]+)"', more).group(1))
    assert set(listed(admin_client.get(link))) == set(rows)


def test_a_short_trail_is_shown_whole(admin_client):
    job = JobFactory()
    AuditEventFactory(target_type="job", target_id=job.pk, action="job.submitted")

    table, more = _trail(admin_client.get(admin_url(job)))

    assert "job.submitted" in table and "Showing all 1: " in more
