import sys

from edge.upstream.cli import main

sys.exit(main())
