import sys

from flodl_run.review.cli import main

sys.exit(main())
