"""The fail-fast hub's messages: framing, the greeting's check, what each side reads, and the reply future."""

import threading

import pytest

from spmd.failfast.hub import messages
from spmd.failfast.hub.base import Reply

pytestmark = pytest.mark.unit


def test_lines_and_payloads_come_whole_however_they_are_split():
    data = messages.line(messages.ERR, "00ff") + messages.framed(messages.STACK, b'{"a": "\\n"}') + messages.line(messages.BYE)
    for cut in range(len(data) + 1):
        reader, got = messages.Reader(), []
        for chunk in (data[:cut], data[cut:]):
            for kind, item in reader.feed(chunk):
                got.append((kind, item))
                if item.startswith(messages.STACK + b" "):
                    reader.expect(int(item.split()[1]))
        assert got == [(messages.LINE, b"ERR 00ff"), (messages.LINE, b"STACK 11"), (messages.PAYLOAD, b'{"a": "\\n"}'),
                       (messages.LINE, b"BYE")], cut


def test_a_line_over_the_limit_or_the_start_of_one_is_too_long():
    reader = messages.Reader()
    assert list(reader.feed(b"x" * (messages.MAX_LINE + 1) + b"\nABORT\n")) == [(messages.TOO_LONG, b""),
                                                                           (messages.LINE, b"ABORT")]
    assert list(reader.feed(b"y" * (messages.MAX_LINE + 1))) == [(messages.TOO_LONG, b"")]
    assert list(reader.feed(b"\nBYE\n")) == [(messages.LINE, b""), (messages.LINE, b"BYE")]  # the start was dropped
    assert list(reader.feed(b"z" * messages.MAX_LINE)) == [] and list(reader.feed(b"\n")) == [(messages.LINE, b"z" * 256)]


def test_the_greeting_needs_a_rank_of_the_job_and_its_secret():
    secret = messages.new_secret()
    address, hello, hub_host = messages.accept_invitation(messages.invitation("10.0.0.1", 4242, secret), 2)
    assert address == ("10.0.0.1", 4242) and hello == b"HELLO 2 " + secret + b"\n" and hub_host is None
    assert messages.check_hello(hello[:-1], 3, secret) == (2, None, None)
    assert messages.check_hello(hello[:-1], 2, secret) == (None, None, "hello")  # no rank 2 in a world of 2
    for junk in (b"HELLO 0 " + secret, b"HELLO x " + secret, b"hello 1 " + secret, b"HELLO 1", b"",
                 b"HELLO 1 " + secret + b" h/2", b"HELLO 1 " + secret + b" " + b"h" * 65, b"HELLO 1 " + secret + b" a b"):
        assert messages.check_hello(junk, 3, secret) == (None, None, "hello"), junk
    assert messages.check_hello(b"HELLO 1 " + messages.new_secret(), 3, secret) == (None, None, "secret")


def test_the_greeting_and_the_invitation_carry_host_names():
    secret = messages.new_secret()
    invitation = messages.invitation("10.0.0.1", 4242, secret, "h1")
    address, hello, hub_host = messages.accept_invitation(invitation, 2, "node-2.cluster")
    assert hub_host == "h1" and hello == b"HELLO 2 " + secret + b" node-2.cluster\n"
    assert messages.check_hello(hello[:-1], 3, secret) == (2, "node-2.cluster", None)
    # a name that could not travel in a line of words is left out, not sent
    assert messages.invitation("10.0.0.1", 1, secret, "a b") == f"10.0.0.1:1 {secret.decode()}"
    assert messages.accept_invitation(invitation, 2, "x\ny")[1] == b"HELLO 2 " + secret + b"\n"


def test_each_side_reads_only_the_exact_words_of_the_other():
    assert messages.rank_says(b"FAIL") == (messages.FAIL,) and messages.rank_says(b"BYE") == (messages.BYE,)
    assert messages.rank_says(b"ERR 0a1b") == (messages.ERR, "0a1b")
    assert messages.rank_says(b"WHERE timeout 90000") == (messages.WHERE, b"timeout", 60.0)  # at most a minute
    assert messages.rank_says(b"STACK 12") == (messages.STACK, 12)
    assert messages.rank_says(b"BEAT") == (messages.BEAT,) and messages.hub_says(b"BEAT") == (messages.BEAT,)
    for junk in (b"FAIL ", b"ERR 0A", b"ERR", b"WHERE nap 10", b"STACK 0", b"STACK %d" % (messages.MAX_STACK + 1),
                 b"ABORT", b"HELLO 1 s", b"BEAT "):
        assert messages.rank_says(junk) is None, junk
    assert messages.hub_says(b"ABORT") == (messages.ABORT,) and messages.hub_says(b"SAME 3") == (messages.SAME, 3)
    assert messages.hub_says(b"REPORT 0") == (messages.REPORT, 0)
    assert messages.verdict(2, 2) == b"FULL\n" and messages.verdict(2, 0) == b"SAME 0\n"
    assert messages.report("r\u00e9") == b"REPORT 3\nr\xc3\xa9"
    for junk in (b"ABORTED", b"ABORT ", b"SAME x", b"REPORT %d" % (messages.MAX_REPORT + 1), b"FAIL", b"BYE BYE"):
        assert messages.hub_says(junk) is None, junk


def test_a_reply_wakes_its_waiter_or_sends_its_answer():
    reply = Reply()
    assert reply.wait(0.01) is None
    threading.Timer(0.05, reply.set, (3,)).start()
    assert reply.wait(5) == 3
    reply.cancel()
    assert reply.wait(0) == 3  # no answer will come: the one given before stays
    sent = []
    Reply(sent.append).set("text")
    assert sent == ["text"]
    empty = Reply()
    empty.cancel()
    assert empty.wait(5) is None
