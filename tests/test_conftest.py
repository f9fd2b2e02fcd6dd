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
])
def test_leak_guard_fails_a_leaking_test(pytester: pytest.Pytester, body: str, message: str) -> None:
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text().replace('pytest_plugins = ["pytester"]', ""))
    pytester.makepyfile(test_leaky=textwrap.dedent(f"""
        def test_leaks():
            {body}
    """))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([f"*{message}*"])
