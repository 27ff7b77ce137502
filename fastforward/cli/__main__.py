"""``python -m fastforward.cli ...`` (what ``torchrun``/``accelerate launch -m fastforward.cli train ...`` run)."""

import sys

from . import main

sys.exit(main())
