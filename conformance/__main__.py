"""``python -m conformance COMMAND [options]``: the suite's commands, from any directory.

    python -m conformance report --backend all --out report/     # the spec, with a report
    python -m conformance bench --sizes 512 1024                  # the benchmark
    python -m conformance frameworks --readme README.md           # the frameworks' table

``python -m conformance COMMAND --help`` describes each command's options.
"""

import importlib
import sys

#: Each command: the module whose ``main(argv)`` runs it, and one line about it.
COMMANDS = {
    "report": ("conformance.report.command", "run the spec on backends and write a report"),
    "bench": ("conformance.bench.run", "time and measure the memory of backends"),
    "frameworks": (
        "conformance.frameworks",
        "measure how the frameworks' own functions differ from the spec (README table)",
    ),
    "walkthrough": ("conformance.walkthrough", "write the walkthroughs' numbers and pictures"),
}


def usage() -> str:
    lines = ["usage: python -m conformance COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<12}{about}" for name, (_, about) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module, _ = COMMANDS[argv[0]]
    return importlib.import_module(module).main(argv[1:]) or 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
