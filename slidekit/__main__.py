"""``python -m slidekit``: the command line of ``slidekit.cli``.

Under torchrun each process is one data-parallel rank:
``torchrun --nproc-per-node 2 -m slidekit finetune --model DIR ...`` (docs/data-parallel.md).
"""

import sys

from slidekit.cli import main

if __name__ == "__main__":
    sys.exit(main())
