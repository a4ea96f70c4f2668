"""``python -m serving [daphne's options] APPLICATION``: daphne with this package's server (``serving.daphne``), as
``simpletuner server`` runs it, for a harness or a process manager that starts daphne itself."""

from .daphne import SpooledBodyCommandLineInterface

SpooledBodyCommandLineInterface.entrypoint()
