from django.urls import re_path

from . import views

urlpatterns = [
    re_path(r"^$", views.JobListView.as_view(), name="queue-list"),
    re_path(r"^submit/?$", views.JobSubmitView.as_view(), name="queue-submit"),
    re_path(r"^(?P<job_id>[\w-]+)/?$", views.JobDetailView.as_view(), name="queue-job"),
    re_path(r"^(?P<job_id>[\w-]+)/cancel/?$", views.JobCancelView.as_view(), name="queue-job-cancel"),
    re_path(r"^(?P<job_id>[\w-]+)/retry/?$", views.JobRetryView.as_view(), name="queue-job-retry"),
    re_path(r"^(?P<job_id>[\w-]+)/log/?$", views.JobLogView.as_view(), name="queue-job-log"),
]
