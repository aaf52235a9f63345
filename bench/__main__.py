"""``python -m bench``: see the package docstring."""

from conformance.bench.run import main

if __name__ == "__main__":
    main()
