"""`symphony serve`: placeholder until the front door lands."""
import sys


def main() -> int:
    print("symphony: serve is not built yet", file=sys.stderr)
    return 1
