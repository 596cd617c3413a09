"""`python -m metrale.cli ...`, the same as the `metrale` script."""
import sys

from . import main

sys.exit(main())
