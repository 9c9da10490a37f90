"""`python -m chaosgpu.workloads hold|ring ...`: see chaosgpu.workloads.cli."""

import sys

from chaosgpu.workloads.cli import main

if __name__ == "__main__":
    sys.exit(main())
