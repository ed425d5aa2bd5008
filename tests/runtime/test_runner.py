"""python -m spmd: the runner's arguments, its exit codes, and the script run as __main__."""

import subprocess

import pytest

from spmd.runtime import runner
from tests.support import PY, clean_env

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("code, want", [(None, 0), (0, 0), (3, 3)])
def test_exit_codes_pass_through(code, want):
    assert runner._exit_code(SystemExit(code)) == want


def test_a_message_as_exit_code_is_printed_and_means_1(capsys):
    assert runner._exit_code(SystemExit("bad input")) == 1
    assert capsys.readouterr().err == "bad input\n"


def test_usage_without_a_script_is_an_error_and_help_is_not(capsys):
    with pytest.raises(SystemExit) as got:
        runner.run_script([])
    assert got.value.code == 2 and runner.USAGE in capsys.readouterr().err
    with pytest.raises(SystemExit) as got:
        runner.run_script(["--help"])
    assert got.value.code == 0 and runner.USAGE in capsys.readouterr().out
    with pytest.raises(SystemExit) as got:
        runner.run_script(["-m"])
    assert got.value.code == 2 and "-m needs a module name" in capsys.readouterr().err
    with pytest.raises(SystemExit) as got:
        runner.run_script(["--ranks", "4", "job.py"])
    assert got.value.code == 2 and "no option '--ranks'" in capsys.readouterr().err


def test_a_missing_script_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as got:
        runner.run_script([str(tmp_path / "nope.py"), "x"])
    err = capsys.readouterr().err
    assert got.value.code == 2
    assert err == f"python -m spmd: cannot open {str(tmp_path / 'nope.py')!r}: no such file\n"


def test_only_the_speaking_rank_says_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("spmd.runtime.start.initialized", lambda: False)  # not a world another test started
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(SystemExit) as got:
        runner.run_script([])
    assert got.value.code == 0 and capsys.readouterr().err == ""  # rank 0 says it, and exits 2


def test_the_script_runs_as_main_with_its_arguments_and_its_exit_status(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import sys\nprint(__name__, sys.argv[1:], sys.path[0])\nsys.exit(int(sys.argv[1]))\n")
    ok = subprocess.run([PY, "-m", "spmd", str(script), "0"], env=clean_env(), capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.split() == ["__main__", "['0']", str(tmp_path)], ok.stderr
    bad = subprocess.run([PY, "-m", "spmd", str(script), "3"], env=clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 3 and "exited with status 3; ending the job" in bad.stderr, bad.stderr
