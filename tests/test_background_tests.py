"""tests/background_tests.py: the files it names run in a second pytest process at idle CPU priority, and
their results come back into the main run's summary and exit code: passes, failures and a crash."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOREGROUND = "tests/router/test_policy.py"  # a fast file of the main process: 7 tests

pytestmark = pytest.mark.skipif(sys.platform != "linux" or (os.cpu_count() or 1) < 2,
                                reason="the split runs on Linux with two or more cores")


@pytest.fixture
def handed_over():
    """Writes a test file under tests/ (so the child loads tests/conftest.py, as it does for the listed files;
    a dot folder, which no collection of tests/ enters) and runs it beside FOREGROUND."""
    folder = Path(tempfile.mkdtemp(prefix=".background-check-", dir=ROOT / "tests"))

    def run(body: str, **env_overrides) -> subprocess.CompletedProcess:
        test_file = folder / "test_handed_over.py"
        test_file.write_text(textwrap.dedent(body))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_TESTS_")}
        env.update(KVRELAY_TESTS_BACKGROUND="1", KVRELAY_TESTS_BACKGROUND_ALSO=str(test_file))
        env.update(env_overrides)
        env = {k: v for k, v in env.items() if v is not None}  # None: unset
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0",
                               "--durations-min=0", FOREGROUND, str(test_file)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    yield run
    shutil.rmtree(folder, ignore_errors=True)


def test_handed_over_tests_run_at_idle_priority_and_report_into_the_main_run(handed_over):
    """A pass, a failure, and a crash that ends the child: the crash fails the test it was running, with the
    child's output, and the test after it is counted as not finished."""
    proc = handed_over("""
        import os
        from pathlib import Path

        def test_runs_at_idle_priority_in_another_process():
            assert os.sched_getscheduler(0) == os.SCHED_IDLE
            assert os.environ.get("KVRELAY_TESTS_CHILD")
            group = Path("/proc/self/autogroup")
            assert not group.exists() or "nice 19" in group.read_text()

        def test_fails_there():
            assert 6 * 7 == 41

        def test_crashes():
            os._exit(3)

        def test_never_runs():
            pass
    """)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "4 of these tests (1 files) run in a second pytest process" in out
    assert "test_handed_over.py::test_fails_there" in out and "assert (6 * 7) == 41" in out, out
    assert "FAILED tests/.background-check-" in out and "test_handed_over.py::test_crashes" in out, out
    assert "exited with 3 during this test (2 of its tests did not finish)" in out, out
    assert "call     tests/.background-check-" in out  # the child's durations, replayed here
    assert "2 failed, 8 passed" in out, out  # test_policy's 7 and the child's one


def test_on_unless_the_environment_says_otherwise(handed_over):
    proc = handed_over("""
        import os

        def test_in_the_child():
            assert os.environ.get("KVRELAY_TESTS_CHILD")
    """, KVRELAY_TESTS_BACKGROUND=None)
    out = proc.stdout
    assert proc.returncode == 0 and "1 of these tests (1 files) run in a second pytest process" in out, out
    assert "8 passed" in out, out


def test_off_by_the_environment(handed_over):
    proc = handed_over("""
        import os

        def test_in_the_main_process():
            assert "KVRELAY_TESTS_CHILD" not in os.environ
    """, KVRELAY_TESTS_BACKGROUND="0")
    assert proc.returncode == 0 and "second pytest process" not in proc.stdout and "8 passed" in proc.stdout, proc.stdout
