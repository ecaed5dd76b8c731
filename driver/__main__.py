"""`python -m driver` is the `fractional` CLI."""

from __future__ import annotations

import sys

from driver.cli import main

sys.exit(main())
