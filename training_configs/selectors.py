"""Reads of stored configs: resolving ``name[@version]``, the latest versions, a config's history."""

from django.db.models import OuterRef, Subquery

from common.errors import InvalidInput
from common.prepared import PreparedQuery

from .models import VERSION_SEPARATOR, TrainingConfig


# Every submit resolves its config name: compiled once.
_LATEST_VERSION = PreparedQuery(lambda *, name: TrainingConfig.objects.filter(name=name).order_by("-version")[:1])
_VERSION = PreparedQuery(lambda *, name, version: TrainingConfig.objects.filter(name=name, version=version)[:1])


def config_resolve(spec):
    """Return the stored version ``spec`` names (``name`` is the latest, ``name@3`` version 3), or None when
    no config of that name is stored. Raise InvalidInput for a malformed version or one the name lacks."""
    name, version = spec, None
    if VERSION_SEPARATOR in spec:
        name, raw = spec.rsplit(VERSION_SEPARATOR, 1)
        if not raw.isascii() or not raw.isdigit() or len(raw) > 9:
            raise InvalidInput(f"{spec!r}: the version after '@' must be a whole number", code="invalid_config_version")
        version = int(raw)
    if version is None:
        return _LATEST_VERSION.first(name=name)
    found = _VERSION.first(name=name, version=version)
    versions = TrainingConfig.objects.filter(name=name)
    if found is None and versions.exists():
        known = ", ".join(str(v) for v in versions.order_by("version").values_list("version", flat=True))
        raise InvalidInput(f"config {name} has no version {version} (it has {known})", code="unknown_config_version")
    return found


def configs_latest():
    """Return the latest version of every stored config, by name."""
    top = TrainingConfig.objects.filter(name=OuterRef("name")).order_by("-version").values("version")[:1]
    return TrainingConfig.objects.filter(version=Subquery(top)).select_related("owner").order_by("name")


def config_names():
    """Return the names of the stored configs, sorted."""
    return sorted(set(TrainingConfig.objects.values_list("name", flat=True)))


def config_versions(name):
    """Return every version of ``name``, newest first."""
    return TrainingConfig.objects.filter(name=name).select_related("owner").order_by("-version")


def config_previous(config):
    """Return the version before ``config``, or None."""
    return TrainingConfig.objects.filter(name=config.name, version__lt=config.version).order_by("-version").first()
