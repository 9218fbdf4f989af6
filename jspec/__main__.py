import sys

from jspec.cli import main

sys.exit(main())
