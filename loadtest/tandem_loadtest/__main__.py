"""``python -m tandem_loadtest``: same as the ``tandem-loadtest`` console script."""

import sys

from tandem_loadtest.cli import main

sys.exit(main())
