from .experts import *  # noqa: F401,F403
from .experts import __all__  # noqa: F401
