"""Models and migrations agree: `makemigrations --check` is a test."""

from io import StringIO

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_no_missing_migrations():
    out = StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=StringIO())
    except SystemExit as exit_:  # --check exits non-zero when a migration would be written
        pytest.fail(f"models and migrations disagree (exit {exit_.code}); run makemigrations:\n{out.getvalue()}")
    assert "No changes detected" in out.getvalue()
