"""Empty PROMETHEUS_MULTIPROC_DIR of the counter files earlier processes left, before the orchestrator's processes start."""

import os
from pathlib import Path

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = (
        "Remove the *.db files that prometheus_client's multiprocess mode leaves in PROMETHEUS_MULTIPROC_DIR, so that "
        "/metrics counts from zero. Run it before any orchestrator process on this host starts (the simpletuner-migrate "
        "unit does). Without PROMETHEUS_MULTIPROC_DIR it does nothing."
    )

    def handle(self, **options):
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
        if not directory:
            self.stdout.write("PROMETHEUS_MULTIPROC_DIR is not set: nothing to clear")
            return
        files = sorted(Path(directory).glob("*.db"))
        for path in files:
            path.unlink(missing_ok=True)
        self.stdout.write(f"Removed {len(files)} file(s) from {directory}")
