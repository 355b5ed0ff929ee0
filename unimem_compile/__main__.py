"""``python -m unimem_compile``: the ``unimem-compile`` command."""

import sys

from .cli import main

sys.exit(main())
