"""The pieces of windows in flight that need no ring: verifying a window whose last row checks the next window's
first token, a request's answers matched to its windows in order (cancelled ones dropped), one frame a request
in a node's batch (its windows compute in order), and the depth's range on every way in."""

import asyncio

import pytest
import torch

from nodes.generation.sampling import Sampler, SamplingParams
from nodes.generation.speculate import SpeculateParams, speculate_params
from nodes.ring import batching
from nodes.ring.head_requests import HeadRequest, RingChanged
from nodes.ring.inbox import Inbox
from nodes.ring.work import Work
from prima_rpc.request import GenerateRequest, RequestError
from prima_rpc.v1 import prima_pb2 as pb


def one_hot(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    """Logits whose greedy draw at row i is tokens[i]."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


@pytest.mark.parametrize("draft, rows, expected", [
    ([1, 2, 3], 3, [1, 2, 3]),     # every row agrees, the last with the next window's first: no token of its own
    ([1, 2, 5], 3, [1, 2, 3]),     # the next window's first is rejected: the target's own token instead
    ([1, 7, 3], 3, [1, 2]),        # rejected inside the window
    ([1, 2], 3, [1, 2, 3]),        # the chain's last window: its last row gives the target's own token
])
def test_a_window_in_flight_is_verified_row_by_row(draft, rows, expected):
    sampler = Sampler(SamplingParams())
    assert sampler.verify(one_hot([1, 2, 3]), draft, rows) == expected
    assert sampler.position == len(expected)  # each position drawn once: the next window's rows go on from here


def test_answers_come_to_windows_by_number_and_cancelled_ones_are_dropped():
    async def run():
        loop = asyncio.get_running_loop()
        req = HeadRequest()
        first, second, third, fourth = (req.expect(loop.create_future(), 2) for _ in range(4))
        assert [w.number for w in (first, second, third, fourth)] == [1, 2, 3, 4]
        req.cancel_after(first)  # a rejection in the first: the second, third and fourth are void
        second.waiter.cancel()
        third.waiter.cancel()
        assert req.live_from == 5  # the restarting window and those after it live
        assert req.deliver(torch.ones(1), 1) == 1 and first.waiter.result().item() == 1.0
        assert req.deliver(torch.zeros(1), 2) == 1  # a cancelled window's answer that came back: dropped
        fifth = req.expect(loop.create_future(), 2)
        assert req.deliver(torch.full((1,), 5.0), 5) == 3  # the third and fourth were dropped on the way
        assert fifth.waiter.result().item() == 5.0 and fourth.waiter.cancelled()
        sixth = req.expect(loop.create_future(), 2)
        req.ring_changed()
        with pytest.raises(RingChanged):
            sixth.waiter.result()
        assert req.front is None

    asyncio.run(run())


def test_an_inbox_drops_the_frames_of_cancelled_windows():
    async def run():
        inbox = Inbox()
        for window, layer in [(2, 0), (3, 5), (2, 5)]:  # window 1 came back and was verified: a rejection
            inbox.put_nowait(Work("a", pb.FORWARD, window, layer, window=window))
        inbox.put_nowait(Work("b", pb.FORWARD, 0, 0, window=7))
        inbox.put_nowait(Work("a", pb.FORWARD, 9, 0, window=4, live_from=4))  # windows 2 and 3 were cancelled
        inbox.put_nowait(Work("a", pb.FORWARD, 7, 9, window=3))  # a later round of a cancelled one: dropped too
        inbox.put_nowait(Work("a", pb.FORWARD, 0, 0))  # unnumbered (a replay): never dropped
        assert [(w.request_id, w.window) for w in [inbox.get_nowait() for _ in range(inbox.qsize())]] == \
            [("b", 7), ("a", 4), ("a", 0)]
        assert inbox.dropped == 4
        inbox.put_nowait(Work("a", pb.RELEASE))
        assert not inbox.live_from

    asyncio.run(run())


def test_a_batch_takes_one_frame_of_a_request():
    async def run():
        inbox = Inbox()
        frames = [Work("a", pb.FORWARD, 0, 5), Work("b", pb.FORWARD, 4, 5), Work("b", pb.FORWARD, 9, 5),
                  Work("c", pb.FORWARD, 2, 5)]
        for w in frames[1:]:
            inbox.put_nowait(w)
        batch = await batching.gather(inbox, frames[0], 8)
        assert [(w.request_id, w.start_pos) for w in batch] == [("a", 0), ("b", 4), ("c", 2)]
        assert inbox.get_nowait() is frames[2]  # b's next window waits for the next compute

    asyncio.run(run())


def test_depth_is_checked_everywhere():
    assert speculate_params("", 0, 0).depth == 1 and speculate_params("ngram", 4, 8).depth == 8
    assert speculate_params("", 0, 0, default_depth=4).depth == 4  # the plan's or the head's choice
    with pytest.raises(ValueError, match="depth must be in"):
        SpeculateParams("ngram", 4, 17)
    with pytest.raises(RequestError, match="depth must be in"):
        GenerateRequest(prompt="Hi", depth=-1)
    assert GenerateRequest.from_wire(GenerateRequest(prompt="Hi", depth=3).to_wire()).depth == 3


def test_a_member_drafts_only_for_its_own_tokenizer_and_in_range(tiny_store):
    from nodes.errors import Rejected
    from nodes.generation.draft import vocab_fingerprint
    from nodes.generation.reference import ReferenceModel
    from nodes.ring.drafts import DraftServer

    server = DraftServer(tiny_store)
    vocab = vocab_fingerprint(ReferenceModel(tiny_store).codec)
    ask = dict(request_id="r", context=[5, 6, 7], n=3, vocab=vocab)
    assert len(server.draft(pb.DraftRequest(**ask))) == 3
    assert server.draft(pb.DraftRequest(**ask)) == server.draft(pb.DraftRequest(**ask | {"request_id": "s"}))
    for bad, code in [({"vocab": "x"}, "FAILED_PRECONDITION"), ({"n": 0}, "INVALID_ARGUMENT"),
                      ({"n": 17}, "INVALID_ARGUMENT"), ({"context": []}, "INVALID_ARGUMENT"),
                      ({"context": [10**6]}, "INVALID_ARGUMENT"), ({"request_id": "r" * 129}, "INVALID_ARGUMENT")]:
        with pytest.raises(Rejected) as err:
            server.draft(pb.DraftRequest(**ask | bad))
        assert err.value.code.name == code
