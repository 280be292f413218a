"""0.1.0's name of `lmbp_convert.enums` (renamed in 0.2.0, this alias goes in 0.3.0): importing it warns."""
from .deprecation import warn_renamed

warn_renamed("lmbp_convert.kinds", "lmbp_convert.enums", stacklevel=2)

from .enums import *  # noqa: E402,F401,F403
from .enums import NormType as NormKind  # noqa: E402,F401
