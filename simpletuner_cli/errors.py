"""The one error the command line reports: a line on stderr and an exit status."""


class CLIError(Exception):
    """A failure to report as one line on stderr; ``status`` is the exit status."""

    def __init__(self, message, status=1):
        super().__init__(message)
        self.status = status
