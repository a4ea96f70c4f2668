"""The job admin page's view of the artifact store: the job's files and each attempt's steps."""

from django.template.defaultfilters import filesizeformat
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from artifacts.selectors import artifacts_for_job, attempt_steps


def artifacts_html(job):
    """Return the table of ``job``'s artifacts: key (a link to its download, which checks the operator's
    ``artifacts.download_artifact`` permission), size, SHA-256, attempt."""
    rows = list(artifacts_for_job(job.pk))
    if not rows:
        return format_html('<span class="st-muted">{}</span>', "no artifacts")

    def key_cell(artifact):
        return format_html('<a href="{}">{}</a>', reverse("artifact-download", kwargs={"artifact_id": artifact.pk}), artifact.key)

    body = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td><code>{}</code></td><td>{}</td></tr>",
        ((key_cell(a), filesizeformat(a.size), a.sha256, a.attempt_number) for a in rows),
    )
    return format_html(
        '<table class="st-artifacts"><thead><tr><th>Key</th><th>Size</th><th>SHA-256</th><th>Attempt</th></tr></thead>'
        "<tbody>{}</tbody></table>",
        body,
    )


def attempt_steps_text(attempt):
    """Return "step A → B" for an attempt: where it started (a resumed checkpoint) and the furthest it reported."""
    start, reached = attempt_steps(attempt.job_id).get(attempt.lease_id, (0, None))
    return f"{start} → {reached if reached is not None else '?'}"
