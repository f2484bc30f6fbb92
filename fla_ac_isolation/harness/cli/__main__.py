"""``python -m fla_ac_isolation.cli``: the ``fla-ac-isolation`` command (e.g. under ``torchrun``)."""

import sys

from fla_ac_isolation.harness.cli import main

sys.exit(main())
