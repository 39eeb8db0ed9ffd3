import sys

from edge.nodes.upstream.cli import main

sys.exit(main())
