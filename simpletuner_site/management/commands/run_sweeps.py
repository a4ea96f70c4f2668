"""Run the periodic sweeps from the command line: each once (--once), or on their schedule until Ctrl-C."""

import logging
import signal
import time

from django.core.management.base import BaseCommand, CommandError

from simpletuner_site.scheduler import EmbeddedScheduler, sweep_schedule

logger = logging.getLogger(__name__)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def describe(result):
    """Return a sweep's result as one line: ``key=value ...`` for a dict, else the value itself."""
    if isinstance(result, dict):
        return " ".join(f"{key}={value}" for key, value in result.items())
    return str(result)


class Command(BaseCommand):
    help = (
        "Run every periodic sweep (stale workers, unacknowledged dispatches, ephemeral cleanup, dispatch) "
        "and print what each did. With --once, run each once and exit (status 1 if one failed); otherwise "
        "run them on their intervals, as the embedded scheduler does, until interrupted."
    )

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="run each sweep once and exit")

    def handle(self, *, once, **options):
        schedule = sweep_schedule()
        if once:
            failed = []
            for name, fn, _interval in schedule:
                try:
                    self.printing(name, fn)()
                except Exception:  # the other sweeps still run
                    logger.exception("sweep %s failed", name)
                    failed.append(name)
            if failed:
                raise CommandError(f"{len(failed)} sweep(s) failed: {', '.join(failed)}")
            return
        for name, fn, interval in schedule:
            self.stdout.write(f"{name}: every {interval:g} s")
        self.stdout.write("Running the sweeps now, then on their intervals; Ctrl-C to stop.")
        printing = [(name, self.printing(name, fn), interval) for name, fn, interval in schedule]
        scheduler = EmbeddedScheduler(schedule=printing)
        previous = signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop: as Ctrl-C
        try:
            for name, fn, _interval in printing:
                scheduler.run_once(name, fn)  # as on the scheduler's thread: a failure is logged, not raised
            scheduler.start()
            self.wait_for_interrupt()
        except KeyboardInterrupt:
            self.stdout.write("Interrupted; stopping.")
        finally:
            signal.signal(signal.SIGTERM, previous)
            scheduler.stop()

    def printing(self, name, fn):
        """Return ``fn`` wrapped to print ``name: result (ms)``, or the error before re-raising it."""

        def run():
            started = time.monotonic()
            try:
                result = fn()
            except Exception as exc:
                self.stderr.write(f"{name}: failed: {type(exc).__name__}: {exc}")
                raise
            elapsed_ms = (time.monotonic() - started) * 1000
            self.stdout.write(f"{name}: {describe(result)} ({elapsed_ms:.1f} ms)")
            self.stdout.flush()  # one line per run, as it happens, also into a pipe or a log file
            return result

        return run

    def wait_for_interrupt(self):
        """Block until Ctrl-C or SIGTERM (KeyboardInterrupt); the sweeps run on the scheduler's thread meanwhile."""
        while True:
            time.sleep(3600)
