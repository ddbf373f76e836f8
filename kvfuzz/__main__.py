"""``python -m kvfuzz``: the ``kvfuzz`` command, for environments where its script is not on PATH."""

import sys

from kvfuzz.cli import main

sys.exit(main())
