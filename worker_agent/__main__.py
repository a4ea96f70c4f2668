"""``python -m worker_agent``: the same program as ``simpletuner worker``."""

import sys

from .cli import main

sys.exit(main())
