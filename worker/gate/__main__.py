"""`python -m worker.gate`: see `worker.gate.cli`."""

import sys

from worker.gate.cli import main

if __name__ == "__main__":
    sys.exit(main())
