"""engine/step_inputs.py: how a scheduled step is flattened on the host."""

from __future__ import annotations

from engine.attention.base import PrefillSpec
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.step_inputs import append_tokens, split_step, step_layout


def scheduled(rid: str, prompt: int, computed: int, new: int,
              blocks: list[int]) -> ScheduledRequest:
    req = Request(rid, list(range(100, 100 + prompt)), SamplingParams(max_tokens=4))
    req.num_computed_tokens = computed
    return ScheduledRequest(req, new, blocks)


def test_decodes_come_first_longest_context_first() -> None:
    short, long = scheduled("s", 3, 2, 1, [0]), scheduled("l", 9, 8, 1, [1])
    chunk = scheduled("c", 20, 4, 6, [2, 3])
    decodes, prefills = split_step(SchedulerOutput([short, chunk, long]))
    assert decodes == [long, short] and prefills == [chunk]


def test_tokens_positions_and_slots() -> None:
    """Slot = block id x block size + offset in the block, across a block boundary."""
    chunk = scheduled("c", 20, 2, 4, [7, 3])
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    append_tokens(chunk, 4, ids, pos, slots)
    assert (ids, pos, slots) == ([102, 103, 104, 105], [2, 3, 4, 5], [30, 31, 12, 13])


def test_the_layout_every_backend_reads() -> None:
    dec = scheduled("d", 5, 4, 1, [9, 8])
    chunk = scheduled("c", 20, 4, 6, [2, 3, 5])
    layout = step_layout([dec], [chunk], [33, 8, 9, 10, 11, 12, 13], 4)
    assert layout.decode_seq_lens == [5] and layout.decode_block_ids == [[9, 8]]
    # the chunk's rows follow the decode's; its context covers 10 tokens: 3 blocks
    assert layout.prefills == [PrefillSpec(q_start=1, q_len=6, ctx_len=10, block_ids=[2, 3, 5])]
    assert layout.slot_mapping == [33, 8, 9, 10, 11, 12, 13]
