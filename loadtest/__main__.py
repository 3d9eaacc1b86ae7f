"""`python -m loadtest ...` is `kvrelay bench ...` (see loadtest/bench.py)."""

import sys

from loadtest.bench import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m loadtest"))
