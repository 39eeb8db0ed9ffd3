import sys

from edge.nodes.sim.cli import main

sys.exit(main())
