"""`python -m runner job=NAME [key=value ...]`: see runner/job.py."""
import sys

from .job import exit_within, main

status = main()
sys.stdout.flush()
exit_within(status)      # everything is written: an exit that hangs must not hold the job
sys.exit(status)
