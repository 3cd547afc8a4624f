"""`python -m memalpha` runs the console script."""

import sys

from memalpha.cli import main

sys.exit(main())
