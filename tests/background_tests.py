"""A second pytest process at the lowest CPU priority for test files that need no Ray and time nothing.

On this project's 2-core machines a one-process run keeps ~1.5 cores busy: the server tests wait on replicas,
and Triton's interpreter and the device script's dry run use one thread. A plain second worker (pytest-xdist)
contends with Ray's replicas, which Ray starts at nice 15, and starves them. So the files below go to a child
pytest under Linux's SCHED_IDLE policy: it runs only on a core nobody else wants and never delays the main
process or Ray. Its tests assert results, not times (a test there that times itself is marked `foreground`
and stays in the main process). The main process runs the rest, then waits for the child.

The child's test reports come back to the main process when its own tests are done (as pytest-xdist's workers'
do): its results, failures and durations are in the one summary and the one exit code.

On unless `KVRELAY_TESTS_BACKGROUND=0` (and never with `--pdb`, `--collect-only` or a run of only these files
or of none). The server tests delete each module's apps when it ends (tests/conftest.py): with every module's
apps left up, a full run peaked at ~22 GB used of 24, and beside this process Ray's memory monitor killed a
worker in the autoscaling test in two runs of three; now it peaks at ~12 GB (docs/results/ci-time-20261207/)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

BACKGROUND_FILES = frozenset({
    # Triton's interpreter (one thread) and the device script: most of the idle core's work
    "tests/kernels/test_flash_attention.py",
    "tests/kernels/test_flashinfer_attention.py",
    "tests/kernels/test_triton_attention.py",
    "tests/kernels/test_triton_layer_ops.py",
    "tests/kernels/test_triton_linear.py",
    "tests/loadtest/test_gpu_check.py",
    "tests/loadtest/test_gpu_check_sweeps.py",
    "tests/workers/test_device.py",
    "tests/workers/test_kernel_variants.py",
    # kernels and the tiny random-weight model against references (no time measured, little memory: a run's
    # late server tests leave Ray's memory monitor little room, and engines of the default model here once
    # pushed it to kill an autoscaled replica)
    "tests/kernels/test_cpu_attention.py",
    "tests/kernels/test_gemv_f32.py",
    "tests/test_background_tests.py",
    "tests/workers/test_async_scheduling.py",
    "tests/workers/test_overlap_outputs.py",
    "tests/workers/test_stream_interval.py",
})
ALSO_ENV = "KVRELAY_TESTS_BACKGROUND_ALSO"  # more files for the child (absolute paths, os.pathsep between): tests
CHILD_ENV = "KVRELAY_TESTS_CHILD"  # in the child: the folder with the node ids it runs; it writes its reports there


class _Child:
    def __init__(self, proc: subprocess.Popen, workdir: Path, count: int):
        self.proc, self.workdir, self.count = proc, workdir, count
        self.started = time.time()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


_child: _Child | None = None
_config: pytest.Config | None = None


def _lowest_priority() -> None:
    """In the child, before exec: SCHED_IDLE (any user may lower its own policy to it). Where the kernel groups
    each session's processes for fair shares (autogroup, on by default on desktops and in many VMs), a session
    of its own would get an equal share against the main one's whole session (pytest and Ray's workers, which
    share it), so the child's session, new here, takes the lowest group priority too (nice 19)."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except FileNotFoundError:  # a kernel without autogroup: SCHED_IDLE alone ranks it below every other task
        pass


def _split_wanted(config: pytest.Config) -> bool:
    return (os.environ.get(CHILD_ENV) is None and os.environ.get("KVRELAY_TESTS_BACKGROUND", "1") != "0"
            and sys.platform == "linux" and (os.cpu_count() or 1) >= 2
            and not config.option.collectonly and not config.option.usepdb)


def _background(item: pytest.Item, root: Path, also: set[Path]) -> bool:
    path = item.path.resolve()
    listed = path in also or (path.is_relative_to(root) and path.relative_to(root).as_posix() in BACKGROUND_FILES)
    return listed and item.get_closest_marker("foreground") is None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config
    config.addinivalue_line("markers", "foreground: stays in the main pytest process (it times itself)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    global _child
    folder = os.environ.get(CHILD_ENV)
    if folder is not None:  # the child: only the items the main process handed over
        wanted = set(Path(folder, "nodeids.txt").read_text().splitlines())
        dropped = [i for i in items if i.nodeid not in wanted]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if i.nodeid in wanted]
        return
    if not _split_wanted(config):
        return
    root = Path(config.rootpath).resolve()
    also = {Path(p).resolve() for p in os.environ.get(ALSO_ENV, "").split(os.pathsep) if p}
    background, foreground = [], []
    for item in items:
        (background if _background(item, root, also) else foreground).append(item)
    if not background or not foreground:
        return
    workdir = Path(tempfile.mkdtemp(prefix="kvrelay-background-tests-"))
    (workdir / "nodeids.txt").write_text("\n".join(i.nodeid for i in background) + "\n")
    (workdir / "locations.json").write_text(json.dumps({i.nodeid: i.location for i in background}))
    files = list(dict.fromkeys(str(i.path) for i in background))
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={workdir / 'tmp'}", *files]
    try:
        with open(workdir / "output.txt", "wb") as out:
            proc = subprocess.Popen(args, cwd=config.invocation_params.dir, stdout=out, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, **{CHILD_ENV: str(workdir)}), stdin=subprocess.DEVNULL,
                                    preexec_fn=_lowest_priority, start_new_session=True)
    except (OSError, subprocess.SubprocessError) as e:  # no idle priority to be had here: one process
        shutil.rmtree(workdir, ignore_errors=True)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"every test runs in this process: no idle priority for a second one ({e})")
        return
    _child = _Child(proc, workdir, len(background))
    items[:] = foreground
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"{len(background)} of these tests ({len(files)} files) run in a second pytest process "
                            "at idle CPU priority (tests/background_tests.py); their results come last")


def _write_report(report) -> None:
    folder = os.environ.get(CHILD_ENV)
    if folder is None or _config is None:
        return
    data = _config.hook.pytest_report_to_serializable(config=_config, report=report)
    with open(Path(folder, "reports.jsonl"), "a") as f:
        f.write(json.dumps(data) + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _write_report(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write_report(report)


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session):
    """In the main process: its own tests, then the child's reports, replayed as if its tests had run here."""
    if _child is None:
        return (yield)
    session.testscollected += _child.count  # the progress counts the child's tests
    try:
        result = yield
    except BaseException:
        _child.kill()
        raise
    main_done = time.time()
    code = _child.proc.wait()
    reports = _child.workdir / "reports.jsonl"
    child_done = reports.stat().st_mtime if reports.exists() else time.time()  # its last report
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        gap = child_done - main_done
        reporter.write("\n")
        reporter.write_line(f"the background pytest ran {child_done - _child.started:.0f} s and finished "
                            f"{abs(gap):.0f} s {'after' if gap > 0 else 'before'} these tests; its {_child.count} results:")
    failed, finished = 0, set()
    for line in reports.read_text().splitlines() if reports.exists() else []:
        report = session.config.hook.pytest_report_from_serializable(config=session.config, data=json.loads(line))
        if isinstance(report.longrepr, list):  # a skip's (file, line, reason), a list after JSON
            report.longrepr = tuple(report.longrepr)
        if isinstance(report, pytest.CollectReport):  # a file that failed to import there
            session.config.hook.pytest_collectreport(report=report)
        else:
            session.config.hook.pytest_runtest_logreport(report=report)
            if report.when == "teardown":
                finished.add(report.nodeid)
        failed += report.failed
    locations = json.loads((_child.workdir / "locations.json").read_text())
    missing = [n for n in locations if n not in finished]
    if missing or (code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) and not failed):
        # it ended before its last test (a crash), or badly without a failed test to show for it: the test it was
        # running fails, with its output
        output = (_child.workdir / "output.txt").read_text(errors="replace")[-20000:]
        nodeid = missing[0] if missing else next(iter(locations))
        session.config.hook.pytest_runtest_logreport(report=pytest.TestReport(
            nodeid, tuple(locations[nodeid]), {}, "failed", f"the background pytest exited with {code} during "
            f"this test ({len(missing)} of its tests did not finish); its output:\n{output}", "call"))
    return result


def pytest_unconfigure(config: pytest.Config) -> None:
    if _child is not None:
        _child.kill()
        shutil.rmtree(_child.workdir, ignore_errors=True)
