"""Entry point for ``python -m weightsync``."""

import sys

from weightsync.tools.cli import main

sys.exit(main())
