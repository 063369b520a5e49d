import sys

from quiesce.ops.cli import main

sys.exit(main())
