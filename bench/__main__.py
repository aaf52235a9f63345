"""``python -m conformance.bench`` (also ``python -m conformance bench``): see the package docstring."""

import sys

from conformance.bench.run import main

if __name__ == "__main__":
    sys.exit(main())
