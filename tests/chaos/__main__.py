"""``python -m tests.chaos --minutes 10``: the soak (see tests/chaos/soak.py, ``--help``);
``python -m tests.chaos atomic --minutes 10``: the atomic-step scenario for longer
(tests/chaos/atomic.py, ``atomic --help``)."""

from __future__ import annotations

import sys

if sys.argv[1:2] == ["atomic"]:
    from tests.chaos.atomic import main as atomic_main

    sys.exit(atomic_main(sys.argv[2:]))

from tests.chaos.soak import main

sys.exit(main())
