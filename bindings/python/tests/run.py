"""Runs the Python binding tests and ends with 'python: N passed, N failed, N skipped'."""
import os
import sys

try:
    import pytest
except ImportError:
    print("python: skipped: pytest is not installed for %s (apt-get install python3-pytest)" % sys.executable)
    print("python: 0 passed, 0 failed, 1 skipped")
    sys.exit(0)


class Count:
    def __init__(self):
        self.n = {"passed": 0, "failed": 0, "skipped": 0}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            if report.outcome in self.n and not (report.when == "teardown" and report.outcome == "skipped"):
                self.n[report.outcome] += 1

    def pytest_collectreport(self, report):
        if report.failed:
            self.n["failed"] += 1


c = Count()
here = os.path.dirname(os.path.abspath(__file__))
rc = pytest.main(["-q", "-rs", "-p", "no:cacheprovider", here] + sys.argv[1:], plugins=[c])
n = c.n
if rc not in (0, 5) and n["failed"] == 0:
    n["failed"] = 1
print("python: %d passed, %d failed, %d skipped" % (n["passed"], n["failed"], n["skipped"]))
sys.exit(0 if n["failed"] == 0 else 1)
