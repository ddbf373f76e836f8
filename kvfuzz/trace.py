"""``kvfuzz.trace`` is :mod:`kvfuzz.saved.trace`, under the name that tests exported before the move import: the
same module object, not a copy."""

import sys

from kvfuzz.saved import trace

sys.modules[__name__] = trace
