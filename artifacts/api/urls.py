from django.urls import path

from . import views

urlpatterns = [
    path("<int:artifact_id>/download", views.ArtifactDownloadView.as_view(), name="artifact-download"),
]
