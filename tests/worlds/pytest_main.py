"""pytest as a job script, for launchers that take a script (bin/submit): pytest_main.py PYTEST_ARGS..."""

import sys

import pytest

sys.exit(pytest.main(sys.argv[1:]))
