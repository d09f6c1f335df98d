"""Joining and prima-ctl against a ring mid-change (real prima-node processes on loopback, SIGKILL for real): a node
started with --join while the survivors still fail over after their head's loss retries with back-off and ends up a
member; a ring command that meets a retriable status runs again until the ring settles, and says why when it does
not, in one line."""

import time

import click
import grpc
import pytest
import typer

from prima_rpc.app import cli_errors, ring
from prima_rpc.app.cli_args import Target
from prima_rpc.app.local_ring import free_ports, wait_serving
from tests.rings import collect, greedy_tokens, local_ring
from tests.test_join import joiner

pytestmark = pytest.mark.slow


def test_a_node_joining_right_after_the_heads_sigkill_ends_up_a_member(tiny_store, tmp_path):
    expected = greedy_tokens(tiny_store, "hello", 8, raw=True)
    with local_ring(tiny_store, 3, tmp_path, windows=[4, 2, 2]) as local:
        head, standby, worker = local.addresses
        log = tmp_path / "joiner.log"
        proc, new = joiner(worker, log, "--cache", str(tmp_path / "cache"), gated=True)
        try:
            while "imported" not in log.read_text():  # its imports done: it joins within a moment of the go
                assert proc.poll() is None, log.read_text()
                time.sleep(0.1)
            local.processes[0].kill()  # the worker still names the dead head: the join meets a ring mid-failover
            proc.stdin.write(b"go\n")
            proc.stdin.close()
            wait_serving(new, proc, 60, log=tmp_path / "joiner.log")
            deadline = time.monotonic() + 90
            while new not in [a for a, _, _ in ring.status(standby)]:
                assert proc.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, "the joiner is not a member within 90 s"
                time.sleep(0.3)
            members = ring.status(standby)
            assert members[0][0] == standby and members[0][2].role == "head"
            assert (new, "joined") in [(a, s) for a, s, _ in members]  # a relay until a plan gives it layers
            assert "asking again" in log.read_text()  # it did meet the ring mid-change
            assert collect(standby, "hello", 8, raw=True)[0] == expected
        finally:
            proc.terminate()
            proc.wait(15)


def test_a_join_that_never_settles_ends_in_one_line(tmp_path):
    gone = f"127.0.0.1:{free_ports(1)[0]}"  # a member nobody serves: it never answers
    log = tmp_path / "joiner.log"
    proc, _ = joiner(gone, log, "--cache", str(tmp_path / "cache"), env={"PRIMA_RETRY_S": "2"})
    assert proc.wait(60) == 2
    text = log.read_text()
    line = text.strip().splitlines()[-1]
    assert line.startswith(f"error: cannot join the ring of {gone}: UNAVAILABLE") and \
        "did not settle within 2 s" in line, line
    assert "Traceback" not in text


def _command(failures: list[grpc.StatusCode]):
    """A ring command that fails with each of `failures` in turn (as prima-ctl's do: `fail_rpc`), then succeeds."""
    runs = []

    def command(ctx: typer.Context) -> str:
        runs.append(time.monotonic())
        if len(runs) <= len(failures):
            cli_errors.fail_rpc(failures[len(runs) - 1], "the ring is re-planning", "127.0.0.1:1")
        return "done"

    return command, runs


def test_a_ring_command_runs_again_while_the_ring_changes(tiny_store, tmp_path, capsys, monkeypatch):
    with local_ring(tiny_store, 1, tmp_path) as local:  # a node that answers: a ring is there, mid-change
        ctx = typer.Context(click.Command("ring-command"), obj=Target(local.addresses[0]))
        command, runs = _command([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
        assert cli_errors.guarded(command, retried=True)(ctx) == "done"
        assert len(runs) == 3
        assert "note: the ring is changing" in capsys.readouterr().err

        monkeypatch.setenv("PRIMA_RETRY_S", "1.5")
        command, runs = _command([grpc.StatusCode.UNAVAILABLE] * 100)
        with pytest.raises(typer.Exit):
            cli_errors.guarded(command, retried=True)(ctx)
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: cannot reach node 127.0.0.1:1") and "did not settle within 2 s" in err[-1]
        assert runs[-1] - runs[0] <= 1.6

        command, runs = _command([grpc.StatusCode.INVALID_ARGUMENT])  # the same on every try: said at once
        with pytest.raises(typer.Exit):
            cli_errors.guarded(command, retried=True)(ctx)
        assert len(runs) == 1


def test_a_ring_command_whose_nodes_do_not_answer_fails_at_once(capsys):
    ctx = typer.Context(click.Command("ring-command"), obj=Target("127.0.0.1:1", nodes=("127.0.0.1:1",)))
    command, runs = _command([grpc.StatusCode.UNAVAILABLE] * 100)
    with pytest.raises(typer.Exit):
        cli_errors.guarded(command, retried=True)(ctx)
    assert len(runs) == 1  # nothing there to settle: no wait
    assert capsys.readouterr().err.startswith("error: cannot reach node 127.0.0.1:1")
