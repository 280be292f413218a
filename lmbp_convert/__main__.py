"""``python -m lmbp_convert SRC DST``: the same as the ``lmbp-convert`` command."""
import sys

from .cli import main

sys.exit(main())
