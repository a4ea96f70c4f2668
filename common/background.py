"""A thread of this process that runs a pass of work whenever it is woken (the audit sealer, the webhook sender).

Work that a commit makes due runs soon after it, off the request that committed: the commit calls ``wake()``
(through ``transaction.on_commit``). The thread starts on the first wake (and again if it was stopped or
died), runs one pass per wake-up (wakes during a pass make one more pass after it), then rests ``pause``
seconds. A pass that fails is logged; the scheduled run of the same work catches up. Around each pass the
thread's database connection is handled as after a request (``close_old_connections``), and closed when the
thread stops.
"""

import logging
import threading

from django.db import close_old_connections, connection

logger = logging.getLogger(__name__)


class WokenThread:
    """Run ``work()`` on a daemon thread named ``name`` whenever woken; ``failed`` is logged when a pass raises.
    ``enabled`` False: ``wake()`` does nothing (tests run the work by hand)."""

    def __init__(self, name, work, *, failed, pause=0.0):
        self.name = name
        self.work = work
        self.failed = failed
        self.pause = pause
        self.enabled = True
        self._wake = threading.Event()
        self._start_lock = threading.Lock()
        self._thread = None
        self._stop = None  # the running thread's own stop signal

    def wake(self):
        """Have the thread run a pass soon, starting it if this process has none (or it was stopped)."""
        if not self.enabled:
            return
        self._wake.set()
        if self._thread is None or not self._thread.is_alive():
            with self._start_lock:
                if self._thread is None or not self._thread.is_alive():
                    self._stop = threading.Event()
                    self._thread = threading.Thread(target=self._run, args=(self._stop,), name=self.name, daemon=True)
                    self._thread.start()

    def stop(self, timeout=10):
        """Stop the thread (after its pass, if it is in one) and wait up to ``timeout`` seconds for it."""
        with self._start_lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._stop.set()
                self._wake.set()
        if thread is not None:
            thread.join(timeout)

    def _run(self, stop):
        while True:
            self._wake.wait()
            if stop.is_set():
                break
            self._wake.clear()
            close_old_connections()
            try:
                self.work()
            except Exception:
                logger.exception(self.failed)
            finally:
                close_old_connections()  # as after a request: a broken connection, or one past its age, goes
            if stop.wait(self.pause):
                break
        connection.close()
