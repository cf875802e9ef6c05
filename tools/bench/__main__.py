"""``python -m kvstore.tools.bench [options]``: see the package docstring."""

import sys

from .run import main

sys.exit(main())
