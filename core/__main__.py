import sys

from quiesce.cli import main

sys.exit(main())
