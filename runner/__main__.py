"""`python -m runner job=NAME [key=value ...]`: see runner/job.py."""
import sys

from .job import main

sys.exit(main())
