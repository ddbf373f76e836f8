"""``kvfuzz.corpus`` is :mod:`kvfuzz.saved.corpus`, under the name that tests exported before the move import: the
same module object, not a copy."""

import sys

from kvfuzz.saved import corpus

sys.modules[__name__] = corpus
