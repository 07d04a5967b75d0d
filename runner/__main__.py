"""`python -m runner job=NAME [key=value ...]`: see runner/driver/job.py."""
import sys

from .driver import job

job.adopt_orphans()    # Ray's processes stay below this one to the end (exit_now)
status = job.main()
if job.EXIT_AT_ONCE:     # a thread left on a stalled store or Ray's start: the exit must not wait
    job.exit_now(status)
sys.stdout.flush()
job.exit_within(status)  # everything is written: an exit that hangs must not hold the job
sys.exit(status)
