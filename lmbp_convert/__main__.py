"""``python -m lmbp_convert SRC DST``: the same as the ``lmbp-convert`` command."""
from .cli import run

run()
