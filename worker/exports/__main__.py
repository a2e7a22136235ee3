"""`python -m worker.exports`: see `worker.exports.cli`."""

import sys

from worker.exports.cli import main

if __name__ == "__main__":
    sys.exit(main())
