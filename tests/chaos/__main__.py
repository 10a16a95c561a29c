"""``python -m tests.chaos --minutes 10``: the soak (see tests/chaos/soak.py, ``--help``)."""

from __future__ import annotations

import sys

from tests.chaos.soak import main

sys.exit(main())
