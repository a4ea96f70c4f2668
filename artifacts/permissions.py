"""The permission of operator actions on artifacts (checked by ``common.permissions``)."""

DOWNLOAD_ARTIFACTS = "artifacts.download_artifact"
