"""The backend contract, checked in one process against every backend that can run there.

Each backend is a world of one: serial; gloo over a HashStore (its direct
hooks and point-to-point scatter and gather); torch.distributed's general
path on the same group (what nccl and torch's mpi run); mpi on
COMM_SELF.  Every check runs twice per backend: as a plain call (direct
hooks offered) and under debug mode (general hooks only, with the
cross-rank fingerprint check), so both paths of every operation are
covered.  Multi-rank behaviour stays with tests/worlds/check_comm.py
under the real launchers (tests/launchers/test_worlds.py).
"""

import abc
import inspect

import numpy as np
import pytest
from tests.support import IN_PROCESS_BACKENDS, open_backend, open_comm

import spmd
from spmd.comms.comm import Backend, Comm, Layout
from spmd.comms.handle import Done, Handle
from spmd.failfast.calls import Monitor
from spmd.config.placement import Placement

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch")

PLACEMENT = Placement(rank=0, size=1, local_rank=0, local_size=1, node_rank=0, num_nodes=1, launcher="none")
BACKENDS = IN_PROCESS_BACKENDS
PATHS = ["direct", "general"]


@pytest.fixture(params=[(b, p) for b in BACKENDS for p in PATHS], ids=lambda bp: f"{bp[0]}-{bp[1]}")
def comm(request, gloo_group):
    backend, path = request.param
    monitor = Monitor(debug=(path == "general"))
    c = open_comm(backend, monitor)
    assert c._mon.active == (path == "general")
    return c


# -- arrays -------------------------------------------------------------------------

NUMPY = [np.float64, np.float32, np.int32, np.int64, np.uint8, np.bool_, np.complex64]
TORCH = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool", "complex64"]
KINDS = [("numpy", d) for d in NUMPY] + [("torch", d) for d in TORCH]
REDUCIBLE = [k for k in KINDS if k[1] not in (np.bool_, "bool", np.complex64, "complex64")]


def make(kind, dtype, values):
    if kind == "numpy":
        return np.asarray(values).astype(dtype)
    return torch.tensor(values).to(getattr(torch, dtype))


def values(a):
    if not isinstance(a, (np.ndarray, torch.Tensor)):
        a = np.asarray(a)
    if isinstance(a, np.ndarray):
        return a.astype(np.complex128) if np.iscomplexobj(a) else a.astype(np.float64)
    if a.is_complex():
        return a.to(torch.complex128).numpy()
    return a.to(torch.float64).numpy()


def same(a, b):
    assert np.array_equal(values(a), values(b)), (a, b)


def kind_of(a):
    return "numpy" if isinstance(a, np.ndarray) else "torch"


def ids(k):
    return f"{k[0]}-{np.dtype(k[1]).name if k[0] == 'numpy' else k[1]}"


# -- the contract itself ---------------------------------------------------------------

def _backend_classes():
    from spmd.comms.backends.mpi.backend import MpiBackend
    from spmd.comms.backends.serial import SerialBackend
    from spmd.comms.backends.torchdist.backend import TorchBackend
    from spmd.comms.backends.torchdist.gloo import GlooBackend
    from spmd.comms.backends.torchdist.nccl import NcclBackend

    return [SerialBackend, TorchBackend, GlooBackend, NcclBackend, MpiBackend]


def _spmd_classes(cls):
    return [k for k in cls.__mro__ if k.__module__.startswith("spmd.")]


def test_every_backend_implements_every_declared_hook_and_comm_holds_it():
    hooks = Backend.__abstractmethods__
    assert {"broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather", "barrier"} <= hooks
    public = {n for k in _spmd_classes(Comm) for n, v in vars(k).items() if not n.startswith("_") and callable(v)}
    assert {"broadcast", "scatter", "all_gather", "split", "barrier", "send", "recv", "isend", "irecv",
            "sendrecv", "send_object", "recv_object", "all_to_all", "reduce_scatter", "scan", "exscan"} <= public
    for cls in _backend_classes():
        assert issubclass(cls, Backend) and not issubclass(cls, Comm), cls
        assert not cls.__abstractmethods__, (cls, cls.__abstractmethods__)
        assert cls.name or cls.__init__.__code__.co_varnames[1] == "name", cls
    for name in hooks:  # each declared hook says what it does
        assert (getattr(Backend, name).__doc__ or "").strip(), name


def test_no_class_of_the_communicator_has_more_than_four_of_spmds_classes_in_its_mro():
    import pkgutil
    import importlib

    import spmd.comms

    seen = 0
    for info in pkgutil.walk_packages(spmd.comms.__path__, "spmd.comms."):
        if info.name.endswith(".nccl") and not torch.cuda.is_available():
            pass  # imports without CUDA all the same
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == info.name:
                seen += 1
                assert len(_spmd_classes(value)) <= 4, (value, _spmd_classes(value))
    assert seen > 20


def test_a_backend_missing_a_hook_cannot_be_made():
    class Half(Backend):
        name = "half"

        def broadcast(self, x, root, async_op):
            return x

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_hooks_take_one_argument_order():
    order = ["root", "op", "out", "async_op"]
    for name in Backend.__abstractmethods__:
        params = list(inspect.signature(getattr(Backend, name)).parameters)[1:]
        tail = [p for p in params if p in order]
        assert tail == sorted(tail, key=order.index), (name, params)
        if "async_op" in params:
            assert params[-1] == "async_op", (name, params)


# -- the backend objects themselves, without Comm ---------------------------------------

@pytest.fixture(params=BACKENDS)
def backend(request, gloo_group):
    return open_backend(request.param)


def test_a_backend_object_runs_each_hook_by_itself(backend):
    x = torch.arange(6.0).reshape(3, 2)
    assert backend.rank == 0 and backend.size == 1 and backend.caches is not None
    assert backend.broadcast(x, 0, False) is x and backend.all_reduce(x, "sum", False) is x
    assert backend.reduce(x, 0, "max", False) is x
    same(x, torch.arange(6.0).reshape(3, 2))
    h = backend.all_reduce(x, "sum", True)
    assert isinstance(h, Handle) and h.wait() is x
    layout = Layout("torch", "float32", (2,), [3])
    same(backend.scatter(None, x, layout, 0, None, False), x)
    same(backend.gather(x, [3], 0, None, False)[0], x)
    same(backend.all_gather(x, [3], None, False)[0], x)
    same(backend.all_to_all(None, x, [3], layout, None, False)[0], x)
    same(backend.reduce_scatter(x, [3], "sum", False), x)
    assert backend.scan(x, False, "sum", False) is x
    backend.barrier()
    row = np.arange(4, dtype=np.int64)
    assert backend.allgather_ints(row).tolist() == [[0, 1, 2, 3]]
    assert backend.broadcast_ints(row, 0).tolist() == [0, 1, 2, 3]
    assert backend.broadcast_object({"a": 1}, 0) == {"a": 1}
    assert backend.gather_object(5, 0) == [5] and backend.all_gather_object(6) == [6]
    assert backend.scatter_object([7], 0) == 7
    got = np.zeros(3)
    backend.send(np.array([1.0, 2.0, 3.0]), 0, 8 * 5, True)
    assert backend.recv(got, 0, 8 * 5, False) == 0 and got.tolist() == [1.0, 2.0, 3.0]
    sub = backend.split(0, 0)
    assert isinstance(sub, type(backend)) and sub.size == 1 and backend.split(None, 0) is None
    sub.free()


def test_a_direct_hook_declines_what_it_cannot_take(backend):
    """The fast path's rule (spmd.comms.contract): x, out and op reach a direct hook unchecked, so it
    returns None for anything it cannot move as it is, and the general path's checks then speak."""
    good = np.arange(6.0)
    cannot = [
        [good, good],                      # a list (coalesce's, never the direct hook's)
        np.arange(12.0)[::2],              # not contiguous
        np.array(["a", "b"]),              # no dtype a backend reduces
        np.array([{}, 1], dtype=object),   # objects
        torch.ones(2, 2).t(),              # a non-contiguous tensor
        "not an array",
        None,
    ]
    for x in cannot:
        assert backend.direct_broadcast(x, 0) is None, x
        assert backend.direct_all_reduce(x, "sum") is None, x
        assert backend.direct_reduce(x, 0, "sum") is None, x
        assert backend.direct_all_gather(x, np.empty(6)) is None, x
        assert backend.direct_gather(x, 0, None) is None, x
    for op in ("mean", None, 3):  # an op the backend does not know
        assert backend.direct_all_reduce(good, op) is None, op
        assert backend.direct_reduce(good, 0, op) is None, op
    for out in (np.empty(5), np.empty(6, np.float32), np.empty(12)[::2], torch.empty(6, dtype=torch.float64)):
        assert backend.direct_all_gather(good, out) is None, out  # out of another shape, dtype or kind
        assert backend.direct_scatter(good, 0, out) is None, out


# -- in-place collectives ----------------------------------------------------------------

@pytest.mark.parametrize("k", KINDS, ids=ids)
def test_broadcast_every_dtype(comm, k):
    x = make(*k, [[1, 0], [1, 1]])
    before = values(x).copy()
    assert comm.broadcast(x, root=0) is x
    same(x, before)
    h = comm.broadcast(x, root=0, async_op=True)
    assert isinstance(h, Handle) and h.wait() is x and h.is_completed()


@pytest.mark.parametrize("k", REDUCIBLE, ids=ids)
def test_reductions_every_op(comm, k):
    for op in ("sum", "prod", "min", "max") + (("avg",) if "float" in str(k[1]) else ()):
        x = make(*k, [3, 2, 1])
        assert comm.all_reduce(x, op=op) is x
        same(x, [3, 2, 1])
        y = make(*k, [1, 2, 3])
        assert comm.reduce(y, root=0, op=op) is y
        same(y, [1, 2, 3])
        z = make(*k, [4, 5])
        assert comm.all_reduce(z, op=op.upper(), async_op=True).wait() is z
        same(z, [4, 5])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_in_place_collectives_write_back_into_non_contiguous_inputs(comm, kind):
    base = make(kind, "float32" if kind == "torch" else np.float32, np.arange(12).reshape(3, 4))
    for call in (
        lambda v: comm.broadcast(v, 0),
        lambda v: comm.all_reduce(v, "max"),
        lambda v: comm.reduce(v, 0, "min"),
        lambda v: comm.all_reduce(v, "sum", async_op=True).wait(),
    ):
        view = base.T if kind == "numpy" else base.t()
        assert call(view) is view
        same(view, np.arange(12).reshape(3, 4).T)


def test_coalesced_and_chunked_all_reduce(comm):
    xs = [np.arange(5.0), np.ones((2, 3), np.float32), torch.arange(4), torch.zeros(0)]
    assert comm.all_reduce(xs) is xs
    same(xs[0], np.arange(5.0))
    same(xs[2], np.arange(4))
    assert comm.all_reduce(xs, async_op=True).wait() is xs
    big = np.arange(1000, dtype=np.float64)
    assert comm.all_reduce(big, chunk_bytes=800) is big
    same(big, np.arange(1000))
    with pytest.raises(spmd.CollectiveError, match="x\\[1\\]|must be a torch.Tensor"):
        comm.all_reduce([np.ones(2), [1, 2]])


# -- scatter and the gathers ---------------------------------------------------------------

@pytest.mark.parametrize("k", KINDS, ids=ids)
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_scatter_and_gathers_every_dtype_and_length(comm, k, rows):
    full = make(*k, np.arange(rows * 3).reshape(rows, 3) % 2)
    mine = comm.scatter(full, root=0)
    assert kind_of(mine) == k[0] and tuple(mine.shape) == (rows, 3)
    same(mine, full)
    as_list = comm.scatter([full], root=0)
    same(as_list, full)
    got = comm.gather(full, root=0)
    assert len(got) == 1 and tuple(got[0].shape) == (rows, 3)
    same(got[0], full)
    everyone = comm.all_gather(full)
    assert len(everyone) == 1 and kind_of(everyone[0]) == k[0]
    same(everyone[0], full)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_scatter_and_gathers_take_non_contiguous_and_many_dims(comm, kind):
    full = make(kind, "float64" if kind == "torch" else np.float64, np.arange(24).reshape(2, 3, 4))
    strided = full[:, ::2]  # non-contiguous, 3-d
    same(comm.scatter(strided, root=0), strided)
    same(comm.gather(strided, 0)[0], strided)
    same(comm.all_gather(strided)[0], strided)
    same(comm.all_gather(full[:, :, 1])[0], full[:, :, 1])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_out_and_equal(comm, kind):
    dt = "int32" if kind == "torch" else np.int32
    x = make(kind, dt, np.arange(6).reshape(3, 2))
    for equal in (False, True):
        out = make(kind, dt, np.zeros((3, 2)))
        assert comm.scatter(x, root=0, equal=equal, out=out) is out
        same(out, x)
        out = make(kind, dt, np.zeros((3, 2)))
        pieces = comm.gather(x, root=0, equal=equal, out=out)
        same(out, x)
        same(pieces[0], x)
        out = make(kind, dt, np.zeros((3, 2)))
        pieces = comm.all_gather(x, equal=equal, out=out)
        same(out, x)
        assert len(pieces) == 1
    same(comm.scatter(x, root=0, equal=True), x)
    same(comm.gather(x, 0, equal=True)[0], x)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_async_scatter_and_gathers(comm, kind):
    x = make(kind, "float32" if kind == "torch" else np.float32, np.arange(8).reshape(4, 2))
    handles = [
        comm.scatter(x, root=0, async_op=True),
        comm.gather(x, root=0, async_op=True),
        comm.all_gather(x, async_op=True),
    ]
    for h in handles:
        assert isinstance(h, Handle)
    same(handles[0].wait(), x)
    same(handles[1].wait()[0], x)
    same(handles[2].wait()[0], x)
    assert all(h.is_completed() for h in handles)
    out = x.copy() if kind == "numpy" else x.clone()
    assert comm.all_gather(x, async_op=True, equal=True, out=out).wait()[0] is not None


# -- objects, barrier, split ------------------------------------------------------------------

def test_objects_barrier_and_split(comm):
    obj = {"a": [1, 2], "b": np.arange(3)}
    assert comm.broadcast_object(obj, 0)["a"] == [1, 2]
    assert comm.gather_object("x", 0) == ["x"]
    assert comm.all_gather_object(7) == [7]
    assert comm.scatter_object(["only"], 0) == "only"
    assert comm.barrier() is None
    sub = comm.split(color=3)
    assert sub is not None and (sub.rank, sub.size, sub.backend) == (0, 1, comm.backend)
    assert type(sub) is type(comm)
    x = np.arange(4.0)
    same(sub.all_gather(x)[0], x)
    same(sub.all_reduce(x), np.arange(4.0))
    assert comm.split(color=None) is None
    assert comm.split(ranks=[0]).size == 1
    watched = len(comm._mon.family)
    sub.free()  # released now, and no longer watched by the timeout watchdogs
    assert len(comm._mon.family) == watched - 1 and sub._mon not in comm._mon.family
    with pytest.raises(spmd.CollectiveError, match="the world communicator ends with spmd.finalize"):
        comm.free()


# -- errors: clear, before anything moves -------------------------------------------------------

def test_bad_arguments_raise_collective_errors(comm):
    x = np.arange(4.0)
    cases = [
        (lambda: comm.broadcast(x, root=1), "root 1 is out of range"),
        (lambda: comm.broadcast(x, root="0"), "out of range"),
        (lambda: comm.reduce(x, root=-1), "out of range"),
        (lambda: comm.gather(x, root=True), "out of range"),
        (lambda: comm.all_reduce(x, op="mean"), "unknown reduction op 'mean'"),
        (lambda: comm.all_reduce(np.arange(3), op="avg"), "floating-point"),
        (lambda: comm.all_reduce([1.0, 2.0]), "must be a torch.Tensor or a numpy.ndarray"),
        (lambda: comm.broadcast(3.0), "must be a torch.Tensor or a numpy.ndarray"),
        (lambda: comm.scatter(None, root=0), "must pass the chunks"),
        (lambda: comm.scatter([x, x], root=0), "expecting 1 chunks"),
        (lambda: comm.scatter(np.array(2.0), root=0), "0-d"),
        (lambda: comm.scatter(x, root=0, out=np.zeros(3)), "out must be a contiguous numpy array"),
        (lambda: comm.gather(x, root=0, out=np.zeros(4, np.float32)), "dtype float64"),
        (lambda: comm.all_gather(x, out=np.zeros((8, 1))[::2, 0]), "non-contiguous"),
        (lambda: comm.all_gather(np.array(1.0)), "at least one dimension"),
        (lambda: comm.split(color=-1), "color must be a non-negative int"),
        (lambda: comm.split(ranks=[0, 0]), "distinct"),
        (lambda: comm.scatter_object([1, 2], 0), "expecting 1 objects"),
    ]
    for call, words in cases:
        with pytest.raises(spmd.CollectiveError, match=words):
            call()
    assert issubclass(spmd.CollectiveError, ValueError)
    # the communicator still works after every refusal
    same(comm.all_gather(x)[0], x)


def test_cuda_tensors_are_refused_on_cpu_backends_and_cpu_data_on_nccl(gloo_group):
    from spmd.comms.backends.torchdist.nccl import NcclBackend

    nccl = Comm(NcclBackend("gloo", timeout=60.0), PLACEMENT)  # nccl's checks on a gloo group
    with pytest.raises(spmd.CollectiveError, match="nccl backend works on CUDA tensors"):
        nccl.all_reduce(torch.ones(2))
    with pytest.raises(spmd.CollectiveError, match="nccl backend works on CUDA tensors"):
        nccl.gather(np.ones(2), 0)
    meta = torch.ones(2, device="meta")
    for backend in ("serial", "gloo", "mpi"):
        with pytest.raises(spmd.CollectiveError, match="works on CPU tensors"):
            open_comm(backend, Monitor()).all_reduce(meta)


# -- bookkeeping: one path for every call ----------------------------------------------------

def test_every_call_is_numbered_once_whatever_the_path(comm):
    x, t = np.ones(4), torch.ones(2, 2)
    start = comm._mon.seq
    comm.all_reduce(x)
    comm.broadcast(t, 0)
    comm.reduce(x, 0)
    comm.scatter(x, 0, equal=True, out=np.empty(4))
    comm.gather(x, 0, equal=True, out=np.empty(4))
    comm.all_gather(x, equal=True, out=np.empty(4))
    comm.all_gather(x)
    comm.barrier()
    assert comm._mon.seq - start == 8
    names = [call.name for call in comm._mon.calls()[-8:]]
    assert names == ["all_reduce", "broadcast", "reduce", "scatter", "gather", "all_gather", "all_gather", "barrier"]
    assert comm._mon.busy == 0


def test_handles():
    assert Done(5).wait() == 5 and Done(5).is_completed()
    calls = []
    h = Handle(lambda: calls.append("wait"), lambda: False, lambda: "result")
    assert not h.is_completed() and calls == []
    assert h.wait() == "result" and h.wait() == "result" and calls == ["wait"]
    assert "done" in repr(h)
    assert Layout("numpy", "float32", (3,), [2]).lengths == [2]


def test_a_handle_runs_its_completion_hooks_before_its_result_latest_first():
    order = []
    h = Handle(lambda: order.append("wait"), lambda: True, lambda: order.append("finish") or "result")
    h.on_complete(lambda: order.append("first added"))
    h.on_complete(lambda: order.append("last added"))
    assert h.is_completed() and h.wait() == "result"
    assert order == ["wait", "last added", "first added", "finish"]


def test_a_handle_bound_to_its_call_waits_through_its_owner_and_a_done_one_stays_unbound():
    class Owner:
        def __init__(self):
            self.seen = []

        def _waiting(self, fn, call, block=True):
            self.seen.append((call, block))
            return fn()

    owner, record = Owner(), (4, "all_reduce", None, "sum", None, (), None)
    h = Handle(lambda: None, lambda: False, lambda: "result")
    h.bind(owner, record)
    assert not h.is_completed() and h.wait() == "result"
    assert owner.seen == [(record, False), (record, True)]
    done = Done("result")
    done.bind(owner, record)
    assert done.wait() == "result" and done._owner is None and len(owner.seen) == 2


# -- point to point (a world of one sends to itself) -------------------------------------------

SHAPES = [(3,), (2, 3), (0, 4), ()]


@pytest.mark.parametrize("k", KINDS, ids=ids)
def test_send_and_recv_every_dtype_and_shape(comm, k):
    for shape in SHAPES:
        x = make(*k, np.arange(int(np.prod(shape))).reshape(shape) % 2)
        comm.send(x, 0, tag=3)
        got = comm.recv(0, tag=3)
        assert got is not x and kind_of(got) == k[0] and tuple(got.shape) == shape, (got, shape)
        assert got.dtype == x.dtype
        same(got, x)
        out = make(*k, np.zeros(shape))
        comm.send(x, 0, tag=4)
        assert comm.recv(None, 4, out=out) is out
        same(out, x)


def test_tags_keep_messages_apart_and_each_tag_is_first_in_first_out(comm):
    comm.send(np.array([1.0]), 0, tag=1)
    comm.send(np.array([2.0]), 0, tag=2)
    comm.send(np.array([3.0]), 0, tag=1)
    got, source, tag = comm.recv(tag=2, status=True)
    assert (got.tolist(), source, tag) == ([2.0], 0, 2)
    assert comm.recv(0, 1).tolist() == [1.0] and comm.recv(0, 1).tolist() == [3.0]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_non_contiguous_sends_and_receives(comm, kind):
    full = make(kind, "float32" if kind == "torch" else np.float32, np.arange(12).reshape(3, 4))
    comm.send(full.T if kind == "numpy" else full.t(), 0)
    got = comm.recv(0)
    same(got, np.arange(12).reshape(3, 4).T)
    target = make(kind, "float32" if kind == "torch" else np.float32, np.zeros((4, 6)))
    into = target[:, ::2]  # non-contiguous out: filled through a copy
    comm.send(full.T if kind == "numpy" else full.t(), 0)
    assert comm.recv(0, out=into) is into
    same(target[:, ::2], np.arange(12).reshape(3, 4).T)
    same(target[:, 1::2], np.zeros((4, 3)))


def test_immediate_forms_and_sendrecv(comm):
    x = torch.arange(6.0).reshape(2, 3)
    pending = comm.irecv(None, tag=7)  # posted before the send it waits for
    assert isinstance(pending, Handle)
    sending = comm.isend(x, 0, tag=7)
    got = pending.wait()
    sending.wait()
    same(got, x)
    assert (pending.source, pending.tag) == (0, 7) and pending.is_completed()
    out = np.empty(3)
    h = comm.irecv(0, 8, out=out)
    comm.send(np.array([1.0, 2.0, 3.0]), 0, 8)
    assert h.wait() is out and out.tolist() == [1.0, 2.0, 3.0]
    same(comm.sendrecv(x, 0, 0, tag=9), x)
    same(comm.sendrecv(np.ones(2), dst=0, tag=9, out=np.zeros(2)), np.ones(2))
    receiving = comm.recv(0, 5, async_op=True)
    assert isinstance(receiving, Handle) and comm.send(x, 0, 5, async_op=True).wait() is None
    same(receiving.wait(), x)  # waited for, as MPI wants of every request


def test_objects_point_to_point(comm):
    comm.send_object({"work": [1, 2, 3], "array": np.arange(3)}, 0, tag=11)
    obj, source, tag = comm.recv_object(None, 11, status=True)
    assert obj["work"] == [1, 2, 3] and obj["array"].tolist() == [0, 1, 2] and (source, tag) == (0, 11)


def test_point_to_point_errors(comm):
    x = np.arange(3.0)
    top = comm._backend.max_tag // 8 - 1
    for call, words in [
        (lambda: comm.send(x, 1), "dst 1 is out of range"),
        (lambda: comm.send(x, -1), "out of range"),
        (lambda: comm.recv(2), "src 2 is out of range"),
        (lambda: comm.send(x, 0, tag=-1), "tag -1 is not allowed"),
        (lambda: comm.send(x, 0, tag="a"), "tag 'a' is not allowed"),
        (lambda: comm.send(x, 0, tag=top + 1), f"integers from 0 to {top}"),
        (lambda: comm.send([1.0], 0), "must be a torch.Tensor or a numpy.ndarray"),
    ]:
        with pytest.raises(spmd.CollectiveError, match=words):
            call()
    comm.send(x, 0, tag=12)
    comm.send(np.arange(2.0), 0, tag=12)
    with pytest.raises(spmd.CollectiveError, match=r"out is a float32 array of shape \(3,\) but rank 0 sent float64"):
        comm.recv(0, 12, out=np.zeros(3, np.float32))
    assert comm.recv(0, 12).tolist() == [0.0, 1.0]  # the mismatched message was drained
    if comm.backend != "mpi":  # MPI's own receive from itself would wait for ever
        with pytest.raises(spmd.CollectiveError, match="nothing was sent"):
            comm.recv(0, 13)


def test_point_to_point_is_numbered_and_traced_but_never_compared(comm):
    start = comm._mon.seq
    comm.send(np.ones(2), 0, 14)
    comm.recv(0, 14)
    assert comm._mon.seq - start == 2
    assert [call.name for call in comm._mon.calls()[-2:]] == ["send", "recv"]
    from spmd.failfast.calls import _describe

    assert "to rank 0 tag 14" in _describe(comm._mon.ring[-2])


# -- all_to_all, reduce_scatter, scans ---------------------------------------------------------

@pytest.mark.parametrize("k", KINDS, ids=ids)
def test_all_to_all_every_dtype(comm, k):
    full = make(*k, np.arange(15).reshape(5, 3) % 2)
    got = comm.all_to_all([full])
    assert len(got) == 1 and kind_of(got[0]) == k[0]
    same(got[0], full)
    same(comm.all_to_all(full)[0], full)
    out = make(*k, np.zeros((5, 3)))
    assert comm.all_to_all(full, out=out, equal=True)[0] is not None
    same(out, full)
    h = comm.all_to_all(full, async_op=True)
    same(h.wait()[0], full)


@pytest.mark.parametrize("k", REDUCIBLE, ids=ids)
def test_reduce_scatter_and_scans_every_op(comm, k):
    for op in ("sum", "prod", "min", "max"):
        x = make(*k, [[3, 1], [2, 2], [1, 3]])
        block = comm.reduce_scatter(x, op)
        assert block is not x and kind_of(block) == k[0] and tuple(block.shape) == (3, 2)
        same(block, x)
        assert comm.scan(x, op) is x
        same(x, [[3, 1], [2, 2], [1, 3]])
        assert comm.exscan(x, op) is x  # rank 0: the op's identity
        same(x, np.full((3, 2), _identity(k, op)))
    y = make(*k, [5, 6])
    assert comm.exscan(y, "sum", async_op=True).wait() is y
    same(y, [0, 0])


def _identity(k, op):
    """What exscan gives rank 0, computed here from numpy's and torch's own dtype limits."""
    if op in ("sum", "prod"):
        return {"sum": 0, "prod": 1}[op]
    kind, dtype = k
    dt = np.dtype(dtype) if kind == "numpy" else getattr(torch, dtype)
    floating = np.issubdtype(dt, np.floating) if kind == "numpy" else dt.is_floating_point
    if floating:
        return np.inf if op == "min" else -np.inf
    info = np.iinfo(dt) if kind == "numpy" else torch.iinfo(dt)
    return info.max if op == "min" else info.min


def test_exchange_errors(comm):
    x = np.arange(4.0)
    for call, words in [
        (lambda: comm.all_to_all([x, x]), "expecting 1 chunks"),
        (lambda: comm.all_to_all(np.array(1.0)), "0-d"),
        (lambda: comm.all_to_all(x, out=np.zeros(3)), "out must be a contiguous numpy array"),
        (lambda: comm.reduce_scatter(np.array(1.0)), "0-d"),
        (lambda: comm.reduce_scatter(x, "mean"), "unknown reduction op"),
        (lambda: comm.scan(x, "avg"), "no prefix form"),
        (lambda: comm.exscan(np.arange(3), "avg"), "floating-point"),
    ]:
        with pytest.raises(spmd.CollectiveError, match=words):
            call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_trace_records_point_to_point_with_bytes_peer_and_tag(backend, gloo_group):
    from spmd.failfast.trace import chrome_trace

    c = open_comm(backend, Monitor(trace="unused.json"))
    c.send(np.ones(10), 0, tag=6)
    c.recv(0, 6)
    events = [e for e in c._mon.events if e["name"] in ("send", "recv")]
    assert [(e["name"], e["bytes"], e["peer"], e["tag"]) for e in events] == [("send", 80, 0, 6), ("recv", 80, 0, 6)]
    args = [e["args"] for e in chrome_trace([events])["traceEvents"] if e["ph"] == "X"]
    assert args[0]["peer"] == 0 and args[1]["tag"] == 6


def test_point_to_point_and_scatter_of_one_shape_keep_their_descriptions_apart(comm):
    x = np.arange(6.0).reshape(3, 2)
    for _ in range(2):  # the second round hits every kept description
        comm.send(x, 0, tag=15)
        same(comm.recv(0, 15), x)
        got = comm.scatter(x, root=0)
        assert got.shape == (3, 2)
        same(got, x)


def test_a_backend_reads_only_what_it_defines():
    """Every ``self.<name>`` a backend's code reads is defined by the backend: a method or class
    attribute of its own classes (the contract's included), or an attribute its code assigns."""
    import ast
    import textwrap

    for cls in _backend_classes():
        mine = [k for k in cls.__mro__ if k.__module__.startswith("spmd.")]
        defined = {name for k in mine for name in vars(k)} | {"__dict__"}
        reads = {}
        for k in mine:
            tree = ast.parse(textwrap.dedent(inspect.getsource(k)))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    if isinstance(node.ctx, ast.Store):
                        defined.add(node.attr)
                    else:
                        reads.setdefault(node.attr, k.__name__)
        strangers = {name: where for name, where in reads.items() if name not in defined}
        assert not strangers, f"{cls.__name__} reads what it does not define: {strangers}"
