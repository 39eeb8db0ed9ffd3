import sys

from edge.sim.cli import main

sys.exit(main())
