"""The SimpleTuner worker agent: runs on a GPU node, takes training jobs from an orchestrator over HTTP.

A standalone client: it imports only the standard library, ``requests``, ``psutil`` and ``pynvml``
(never Django), so a GPU node installs it alone (see docs/agent-guide.md, "Installing it on a GPU node").
"""

__version__ = "0.2.0"
