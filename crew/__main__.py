import sys

from crew.cli import main

sys.exit(main())
