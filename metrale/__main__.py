"""`python -m metrale ...`, the same as the `metrale` script (and `python -m metrale.cli`)."""
import sys

from metrale.cli import main

sys.exit(main())
