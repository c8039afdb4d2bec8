"""The sandbox that runs a model's code: how a run ends (passed, a failed assert, the timeout, the
memory limit), where it writes, and what environment it sees."""
import os

from forerun.eval.sandbox import Limits, run_python


def test_a_passing_program():
    out = run_python("def f(x):\n    return 2 * x\n\nassert f(2) == 4\n")
    assert out.passed and out.error is None and out.detail == "" and out.seconds < 5


def test_a_failing_assert_names_the_error_and_its_line():
    out = run_python("print('noise on stdout')\nassert 1 + 1 == 3, 'bad sum'\n")
    assert not out.passed and out.error == "AssertionError" and out.detail == "AssertionError: bad sum"


def test_an_infinite_loop_is_killed_at_the_timeout():
    out = run_python("while True:\n    pass\n", Limits(timeout_s=1.0))
    assert not out.passed and out.error == "timeout" and 1.0 <= out.seconds < 5


def test_a_memory_bomb_is_stopped_by_the_address_space_limit():
    # 3 GiB of untouched zero pages is cheap without a limit: only the limit can refuse it
    out = run_python("block = bytearray(3 << 30)\n")
    assert not out.passed and out.error == "MemoryError"


def test_files_are_written_only_in_a_fresh_scratch_folder_that_goes_away(tmp_path, monkeypatch):
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    code = (
        "import os, tempfile\n"
        f"assert os.getcwd().startswith({str(tmp_path / 'root')!r}), os.getcwd()\n"
        "assert os.listdir('.') == [], os.listdir('.')\n"
        "open('written.txt', 'w').write('x')\n"
        "assert tempfile.gettempdir() == os.getcwd() == os.path.expanduser('~')\n"
    )
    (tmp_path / "root").mkdir()
    out = run_python(code, root=str(tmp_path / "root"))
    assert out.passed, out.detail
    assert list((tmp_path / "root").iterdir()) == [] and list(here.iterdir()) == []


def test_the_environment_is_built_from_nothing(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("FORERUN_SECRET", "s3cret")
    out = run_python("import os\nassert set(os.environ) <= {'PATH', 'HOME', 'TMPDIR', 'LANG', 'LC_CTYPE'}, "
                     "sorted(os.environ)\n")
    assert out.passed, out.detail
    assert os.environ["HTTPS_PROXY"]  # the parent's own environment is untouched


def test_a_large_file_write_fails():
    out = run_python("open('big', 'wb').write(b'x' * (2 << 20))\n", Limits(file_bytes=1 << 20))
    assert not out.passed and out.error == "OSError" and "too large" in out.detail
