"""Where the tests find the repository's parts, whatever folder a test file sits in."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
