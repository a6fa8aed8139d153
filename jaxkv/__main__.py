import sys

from jaxkv.entrypoints.cli import main

sys.exit(main())
