import sys

from lightning_hybrid.cli import main

sys.exit(main())
