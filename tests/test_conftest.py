"""The leak guards themselves must be able to fail."""

import textwrap

import pytest

from tests.conftest import ROOT


@pytest.mark.multiprocess  # each case is a pytest run of its own (the conftest imports torch)
@pytest.mark.parametrize("body, message", [
    ("import os; os.environ['MGPU_LEAK'] = '1'", "environment variables leaked"),
    ("import subprocess; subprocess.Popen(['sleep', '30'])", "child processes left running"),
    ("import torch.distributed as dist; dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)",
     "process group was left initialised"),
    ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)", "signal handlers leaked: *SIGTERM"),
    ("import conftest; conftest.popen_rank(['-c', 'import time; time.sleep(30)'], conftest.base_env())",
     "child processes left running"),  # a rank forked by the warm-start server (tests/warm_start.py)
])
def test_leak_guard_fails_a_leaking_test(pytester: pytest.Pytester, body: str, message: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the copied conftest imports tests.warm_start
    monkeypatch.delenv("MGPU_TEST_COLD_START", raising=False)
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text().replace('pytest_plugins = ["pytester"]', ""))
    pytester.makepyfile(test_leaky=textwrap.dedent(f"""
        def test_leaks():
            {body}
    """))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([f"*{message}*"])


@pytest.mark.multiprocess
def test_a_failing_test_is_reported_once_under_pytest_timeout(pytester: pytest.Pytester,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest-timeout (setup.cfg: timeout) resets SIGALRM when a test fails, before the guard's teardown: the guard
    # added an error ("signal handlers leaked: ['SIGALRM']") to every failed test, and put back a finished test's
    # timeout handler.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text().replace('pytest_plugins = ["pytester"]', ""))
    pytester.makepyfile(test_failing="def test_fails():\n    assert False\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--timeout", "600", "--timeout-method", "signal")
    result.assert_outcomes(failed=1, errors=0)
    assert "leaked" not in result.stdout.str()
