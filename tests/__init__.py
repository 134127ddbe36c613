"""The tests, laid out as the code is (``tests/<package>/test_<module>.py``)."""

from pathlib import Path

#: The repository's root: the files the tests read and the folder their subprocesses run in, wherever
#: the test file sits below ``tests/``.
ROOT = Path(__file__).resolve().parent.parent
