"""Settings.parse on fake environments: defaults, good values, and bad ones named with what is allowed."""

import datetime
import signal

import pytest

from spmd.runtime import backends
from spmd.runtime import start as runtime
from spmd.cli import run as cli_run
from spmd.errors import BackendError, SettingsError
from spmd.config.settings import BACKENDS, DEFAULT_TIMEOUT, VARIABLES, Settings, parse_preempt_signal
from spmd.submit import options

pytestmark = pytest.mark.unit


def test_defaults():
    s = Settings.parse({})
    assert s == Settings()
    assert (s.backend, s.timeout, s.debug, s.trace) == ("auto", DEFAULT_TIMEOUT, False, None)
    assert (s.keep_results, s.port, s.preempt_signal, s.listen_fd) == (None, None, None, None)
    assert s.torch_group is None  # auto: on when torch is imported at init
    assert s.tag_output is False


def test_blank_variables_are_unset():
    blank = {name: "" for name in VARIABLES.values()}
    assert Settings.parse(blank) == Settings()
    assert Settings.parse({"SPMD_KEEP_RESULTS": "  ", "SPMD_PORT": " "}) == Settings()


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        Settings().timeout = 5


def test_every_field_has_its_variable():
    assert set(VARIABLES) == set(Settings.__dataclass_fields__)
    assert all(name.startswith("SPMD_") for name in VARIABLES.values())


@pytest.mark.parametrize("env, field, value", [
    ({"SPMD_BACKEND": "gloo"}, "backend", "gloo"),
    ({"SPMD_BACKEND": " MPI "}, "backend", "mpi"),
    ({"SPMD_TIMEOUT": "30"}, "timeout", 30.0),
    ({"SPMD_TIMEOUT": "0.5"}, "timeout", 0.5),
    ({"SPMD_DEBUG": "1"}, "debug", True),
    ({"SPMD_DEBUG": "Yes"}, "debug", True),
    ({"SPMD_DEBUG": "0"}, "debug", False),
    ({"SPMD_DEBUG": "off"}, "debug", False),
    ({"SPMD_TRACE": "path"}, "trace", "path"),
    ({"SPMD_TRACE": "/tmp/t.json"}, "trace", "/tmp/t.json"),
    ({"SPMD_KEEP_RESULTS": "512M"}, "keep_results", 512 << 20),
    ({"SPMD_KEEP_RESULTS": "0"}, "keep_results", 0),
    ({"SPMD_KEEP_RESULTS": "4096"}, "keep_results", 4096),
    ({"SPMD_PORT": "29500"}, "port", 29500),
    ({"SPMD_PORT": "1"}, "port", 1),
    ({"SPMD_PORT": "65535"}, "port", 65535),
    ({"SPMD_PREEMPT_SIGNAL": "USR2"}, "preempt_signal", signal.SIGUSR2),
    ({"SPMD_PREEMPT_SIGNAL": "SIGTERM"}, "preempt_signal", signal.SIGTERM),
    ({"SPMD_PREEMPT_SIGNAL": "10"}, "preempt_signal", 10),
    ({"SPMD_LISTEN_FD": "7"}, "listen_fd", 7),
    ({"SPMD_LISTEN_FD": "0"}, "listen_fd", 0),
    ({"SPMD_TORCH_GROUP": "auto"}, "torch_group", None),
    ({"SPMD_TORCH_GROUP": " AUTO "}, "torch_group", None),
    ({"SPMD_TORCH_GROUP": "1"}, "torch_group", True),
    ({"SPMD_TORCH_GROUP": "On"}, "torch_group", True),
    ({"SPMD_TORCH_GROUP": "yes"}, "torch_group", True),
    ({"SPMD_TORCH_GROUP": "0"}, "torch_group", False),
    ({"SPMD_TORCH_GROUP": "false"}, "torch_group", False),
    ({"SPMD_TORCH_GROUP": "off"}, "torch_group", False),
    ({"SPMD_TAG_OUTPUT": "1"}, "tag_output", True),
    ({"SPMD_TAG_OUTPUT": "off"}, "tag_output", False),
    ({"SPMD_HIERARCHY": " Auto "}, "hierarchy", "auto"),
    ({"SPMD_HIERARCHY": "on"}, "hierarchy", "on"),
    ({"SPMD_HIERARCHY": "1"}, "hierarchy", "on"),
    ({"SPMD_HIERARCHY": "off"}, "hierarchy", "off"),
    ({"SPMD_HIERARCHY": "no"}, "hierarchy", "off"),
    ({}, "pipelined", "auto"),
    ({"SPMD_PIPELINED": "ON"}, "pipelined", "on"),
    ({"SPMD_PIPELINED": "0"}, "pipelined", "off"),
])
def test_good_values(env, field, value):
    assert getattr(Settings.parse(env), field) == value


@pytest.mark.parametrize("env, words", [
    ({"SPMD_PORT": "abc"}, ["SPMD_PORT='abc'", "not a port", "1 to 65535"]),
    ({"SPMD_PORT": "70000"}, ["SPMD_PORT='70000'", "not a port", "1 to 65535"]),
    ({"SPMD_PORT": "0"}, ["SPMD_PORT='0'", "1 to 65535"]),
    ({"SPMD_TIMEOUT": "-1"}, ["timeout must be a positive number of seconds", "'-1'", "SPMD_TIMEOUT"]),
    ({"SPMD_TIMEOUT": "0"}, ["positive number of seconds", "'0'", "SPMD_TIMEOUT"]),
    ({"SPMD_TIMEOUT": "soon"}, ["positive number of seconds", "'soon'", "SPMD_TIMEOUT"]),
    ({"SPMD_TIMEOUT": "nan"}, ["positive number of seconds", "'nan'", "SPMD_TIMEOUT"]),
    ({"SPMD_KEEP_RESULTS": "lots"}, ["SPMD_KEEP_RESULTS='lots' is not a size", "K, M or G", "512M", "or 0"]),
    ({"SPMD_KEEP_RESULTS": "5T"}, ["SPMD_KEEP_RESULTS='5T' is not a size", "512M"]),
    ({"SPMD_DEBUG": "verbose"}, ["SPMD_DEBUG='verbose'", "1, true, yes or on", "0, false, no, off"]),
    ({"SPMD_PREEMPT_SIGNAL": "NOPE"}, ["unknown signal 'NOPE'", "SPMD_PREEMPT_SIGNAL", "USR1"]),
    ({"SPMD_PREEMPT_SIGNAL": "0"}, ["unknown signal '0'", "SPMD_PREEMPT_SIGNAL", "a number from 1"]),
    ({"SPMD_LISTEN_FD": "x"}, ["SPMD_LISTEN_FD='x'", "not a file descriptor", "0 or more"]),
    ({"SPMD_LISTEN_FD": "-3"}, ["SPMD_LISTEN_FD='-3'", "0 or more"]),
    ({"SPMD_TORCH_GROUP": "gloo"}, ["SPMD_TORCH_GROUP='gloo'", "not auto, on or off", "auto (or nothing)",
                                    "1, true, yes or on", "0, false, no or off"]),
    ({"SPMD_TORCH_GROUP": "2"}, ["SPMD_TORCH_GROUP='2'", "not auto, on or off"]),
    ({"SPMD_TAG_OUTPUT": "rank"}, ["SPMD_TAG_OUTPUT='rank'", "1, true, yes or on", "0, false, no, off"]),
    ({"SPMD_HIERARCHY": "hosts"}, ["SPMD_HIERARCHY='hosts'", "not auto, on or off", "off to keep"]),
    ({"SPMD_PIPELINED": "ring"}, ["SPMD_PIPELINED='ring'", "not auto, on or off", "off to keep"]),
])
def test_bad_values_name_variable_value_and_what_is_allowed(env, words):
    with pytest.raises(SettingsError) as caught:
        Settings.parse(env)
    assert isinstance(caught.value, ValueError)
    for w in words:
        assert w in str(caught.value)


def test_an_unknown_backend_is_a_backend_error():
    with pytest.raises(BackendError, match="unknown backend 'tcp' \\(from SPMD_BACKEND\\).*auto, gloo, nccl, mpi"):
        Settings.parse({"SPMD_BACKEND": "tcp"})
    with pytest.raises(BackendError, match="unknown backend 'tcp' \\(from backend argument\\)"):
        Settings.parse({}, backend="tcp")


def test_arguments_win_over_the_environment():
    env = {"SPMD_BACKEND": "mpi", "SPMD_TIMEOUT": "30", "SPMD_DEBUG": "1", "SPMD_TRACE": "env.json"}
    s = Settings.parse(env, backend="gloo", timeout=5, debug=False, trace="arg.json")
    assert (s.backend, s.timeout, s.debug, s.trace) == ("gloo", 5.0, False, "arg.json")
    assert Settings.parse({"SPMD_BACKEND": "infiniband"}, backend="gloo").backend == "gloo"
    assert Settings.parse({}, timeout=datetime.timedelta(minutes=2)).timeout == 120.0


def test_torch_group_argument_wins_over_the_environment():
    assert Settings.parse({"SPMD_TORCH_GROUP": "0"}, torch_group=True).torch_group is True
    assert Settings.parse({"SPMD_TORCH_GROUP": "1"}, torch_group=False).torch_group is False
    assert Settings.parse({"SPMD_TORCH_GROUP": "0"}, torch_group="auto").torch_group is None
    assert Settings.parse({"SPMD_TORCH_GROUP": "bad"}, torch_group="on").torch_group is True
    assert Settings.parse({"SPMD_TORCH_GROUP": "0"}).torch_group is False  # None: the variable decides
    with pytest.raises(SettingsError, match="'sometimes' from the torch_group argument is not auto, on or off"):
        Settings.parse({}, torch_group="sometimes")
    with pytest.raises(SettingsError, match="3 from the torch_group argument"):
        Settings.parse({}, torch_group=3)


def test_bad_arguments_are_named():
    with pytest.raises(SettingsError, match="positive number of seconds, got -2 from the timeout argument"):
        Settings.parse({"SPMD_TIMEOUT": "30"}, timeout=-2)
    with pytest.raises(SettingsError, match="got <object object"):
        Settings.parse({}, timeout=object())


def test_the_old_entry_points_agree():
    assert runtime._timeout(None, {"SPMD_TIMEOUT": "30"}) == 30.0
    assert runtime.DEFAULT_TIMEOUT == DEFAULT_TIMEOUT
    assert backends.requested_backend(None, {"SPMD_BACKEND": "Gloo"}) == "gloo"
    assert parse_preempt_signal({}, "term") == signal.SIGTERM


def test_backend_names_have_one_source():
    assert backends.BACKENDS is BACKENDS
    assert cli_run.BACKENDS is BACKENDS
    assert options.BACKENDS is BACKENDS
