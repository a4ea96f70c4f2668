"""`python -m simpletuner_cli` runs the `simpletuner` console script."""

import sys

from .main import main

sys.exit(main())
