"""Fail-fast: the hub, ending the job on a failure, the one report, the call records."""
