"""``python -m aiollama``: the same as the ``aiollama`` command."""

import sys

from aiollama.cli import main

sys.exit(main())
