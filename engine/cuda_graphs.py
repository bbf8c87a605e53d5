"""Decode steps replayed from CUDA graphs (the Triton backends).

A decode step of a small model is hundreds of short kernel launches, and launching them
from Python costs more than the GPU spends running them (seen on an H100: ~17 ms a step
for SmolLM2-135M's 30 layers, eager). So, as vLLM and SGLang do, the forward pass of a
decode-only batch is captured once per padded batch size and replayed: one launch for the
whole step, and the engine thread holds the GIL only to fill the inputs.

Everything a captured graph reads lives in static buffers sized for the largest batch:
token ids, positions, cache slots, block tables, context lengths. A batch of n decodes
runs the graph of the smallest captured size b >= n; rows n..b are padding: token 0 at
position 0, cache slot -1 (the cache write skips it), context length 1 over whatever
block table row is there (valid block ids, so the reads stay in bounds); their logits are
dropped. The kernels size their loops from the context lengths they load, so one graph
serves every context up to max_model_len. A decode batch whose longest context would take
the split-K kernel (SPLIT_K_MIN_CONTEXT) runs eagerly, as does any step with a prefill.

Under the Triton interpreter (`triton-interpret`, CPU tensors) nothing is captured: the
same static-buffer forward runs eagerly on every replay, so the padding logic is tested
on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.triton import SPLIT_K_MIN_CONTEXT, TritonMetadata

Forward = Callable[[torch.Tensor, torch.Tensor, object, torch.Tensor], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (itself included)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sizes


class DecodeGraphs:
    def __init__(self, forward: Forward, device: torch.device, max_num_seqs: int,
                 max_blocks_per_seq: int, capture: bool) -> None:
        """`forward(input_ids, positions, meta, logits_rows) -> logits`: the model's."""
        self.forward = forward
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.capture = capture
        big, dev, width = self.sizes[-1], device, max_blocks_per_seq
        # The step inputs live in two device buffers, so that a step's go up in two
        # copies: int64 rows (token ids, positions, cache slots) and int32 (context
        # lengths, then the block tables). Each has a host twin, pinned on a GPU (the
        # copies are then asynchronous DMA), filled through numpy views.
        self._dev64 = torch.zeros((3, big), dtype=torch.int64, device=dev)
        self._dev64[2] = -1
        self.input_ids, self.positions, self.slot_mapping = self._dev64.unbind(0)
        self._dev32 = torch.zeros(big + big * width, dtype=torch.int32, device=dev)
        self._dev32[:big] = 1
        self.seq_lens = self._dev32[:big]
        self.block_tables = self._dev32[big:].view(big, width)
        pin = device.type == "cuda"
        self._host64 = self._dev64.cpu().pin_memory() if pin else self._dev64.clone()
        self._host32 = self._dev32.cpu().pin_memory() if pin else self._dev32.clone()
        self._h64 = self._host64.numpy()
        self._h32 = self._host32.numpy()
        self._h_tables = self._h32[big:].reshape(big, width)
        self._width = width
        self._copied = torch.cuda.Event() if pin else None  # the last copies are done
        self.query_start_loc = torch.arange(big + 1, dtype=torch.int32, device=dev)
        self.logits_rows = torch.arange(big, dtype=torch.int64, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0

    def _meta(self, b: int) -> TritonMetadata:
        # max_seq_len 1 keeps the (graph-safe) one-pass kernel; see fits()
        return TritonMetadata(self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b],
                              self.query_start_loc[: b + 1], 1, 1, True)

    def _run_static(self, b: int) -> torch.Tensor:
        return self.forward(self.input_ids[:b], self.positions[:b], self._meta(b),
                            self.logits_rows[:b])

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first (the later ones reuse its memory pool). Each
        size runs once eagerly first, which compiles its kernels: nothing compiles or
        allocates anew during a capture. The padding inputs make those runs write no
        cache slot."""
        if not self.capture:
            return
        pool = None
        for b in reversed(self.sizes):
            self._run_static(b)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._run_static(b)
            pool = graph.pool() if pool is None else pool
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)

    def fits(self, num_seqs: int, max_context: int) -> bool:
        return 0 < num_seqs <= self.sizes[-1] and max_context < SPLIT_K_MIN_CONTEXT

    @torch.inference_mode()
    def run(self, token_ids: list[int], positions: list[int], slots: list[int],
            block_ids: list[list[int]]) -> torch.Tensor:
        """One decode per sequence (context = position + 1): logits [n, vocab] in the
        model's dtype, a view into the graph's output, valid until the next replay."""
        n = len(token_ids)
        b = next(s for s in self.sizes if s >= n)
        if self._copied is not None:
            self._copied.synchronize()  # (long done: the last step's tokens came back)
        h, lens, tables = self._h64, self._h32, self._h_tables
        h[0, :n] = token_ids
        h[1, :n] = positions
        h[2, :n] = slots
        h[:2, n:b] = 0
        h[2, n:b] = -1
        lens[:n] = positions
        lens[:n] += 1
        lens[n:b] = 1
        for i, ids in enumerate(block_ids):  # (entries past a row's context are never read)
            tables[i, :len(ids)] = ids
        nb = self._copied is not None
        self._dev64.copy_(self._host64, non_blocking=nb)
        used = self.sizes[-1] + n * self._width
        self._dev32[:used].copy_(self._host32[:used], non_blocking=nb)
        if self._copied is not None:
            self._copied.record()
        self.replays += 1
        if b not in self._graphs:  # not captured (the interpreter): the same forward, eagerly
            return self._run_static(b)[:n]
        graph, out = self._graphs[b]
        graph.replay()
        return out[:n]
