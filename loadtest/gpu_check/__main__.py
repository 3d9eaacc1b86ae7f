"""`python -m loadtest.gpu_check --prepare DIR | --model DIR --out DIR | --dry-run --out DIR`."""

import sys

from loadtest.gpu_check.run import main

if __name__ == "__main__":
    sys.exit(main())
