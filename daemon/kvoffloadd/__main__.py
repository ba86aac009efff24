import sys

from kvoffloadd.main import main

sys.exit(main())
