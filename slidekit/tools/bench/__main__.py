"""``python -m slidekit.tools.bench``: one slidekit benchmark process (``slidekit_run.main``)."""

from __future__ import annotations

import sys

from slidekit.tools.bench.slidekit_run import main

if __name__ == "__main__":
    sys.exit(main())
