"""``python -m conformance report --backend all --out report/``: see conformance/report.py."""

import sys

from conformance import report

USAGE = "usage: python -m conformance report --backend NAME|all [--out DIR] [pytest options]"

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "report":
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(report.main(sys.argv[2:]))
