"""The fast runner: a FastModel over preallocated slot state, decode captured as CUDA graphs.

    runner = Runner(make_fast(load_model(path).cuda()), max_seqs=8, max_len=8192)
    slot = runner.allocate()
    logits = runner.prefill(slot, prompt_ids)              # module path, any length, chunked by the caller
    logits = runner.decode([slot, ...], next_ids)          # one token per sequence: a graph replay
    logits = runner.resume(slot, from_slot, length, ids)   # prefix hit: restore (copy), bounded replay + ids

Decode runs `FastModel.decode_step` for a batch padded up to the next captured size (padding rows use
the scratch slot, whose writes nobody reads); the graph for each size is captured on first use, or ahead
by `capture` (`warm_up` also compiles the prefill for every chunk length: the engine does it when it is
built). A resumed slot's bounded replay is the same step over the window's positions of that one slot, captured
once (on first use). Without CUDA (or with `cuda_graphs=False`) the same step runs eagerly. Positions live in device
memory, so a decode step needs no host synchronization: the host only tracks lengths to reject overflows.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dsv4.fast.cache import SlotCache, SlotState
from dsv4.fast.model import FastModel

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def write_padded(dst: torch.Tensor, values: torch.Tensor, fill: int) -> None:
    """dst [size] <- values [B <= size], then `fill` in the rows past them, in place (a captured graph's input):
    one copy (from pinned memory, so the host does not wait for the device) and a fill only for padding rows,
    where an upload, a pad and a copy each went through a temporary."""
    B = values.shape[0]
    if values.device.type == "cpu" and dst.is_cuda:
        values = values.pin_memory()
    dst[:B].copy_(values, non_blocking=True)
    if B < dst.shape[0]:
        dst[B:].fill_(fill)


class OutOfSlots(RuntimeError):
    """Every sequence slot is taken: release one (or make the runner with more max_seqs)."""


class Runner:
    """Args:
        model: a FastModel (`dsv4.fast.model.make_fast`) on its device.
        max_seqs: sequence slots; max_len: tokens per slot (prompt + generation).
        cuda_graphs: capture decode steps (default: on a CUDA device).
        compile: run the decode step's parts through torch.compile (`FastModel.compile_decode`: compiles per
            layer kind, for batch 1 and one symbolic batch), and the prefill's cache-free pieces
            (`FastModel.compile_prefill`); default: on a CUDA device; a string names the
            torch.compile backend instead of inductor (the tests trace with "aot_eager" on the host, where
            inductor's C++ code cannot hold the float8_e8m0fnu scales).
        batch_sizes: decode batch sizes to capture; a batch runs padded to the next one.
        resume_span: how far a slot may move past a prefix and still be resumed from it (SlotState).
    """

    def __init__(
        self,
        model: FastModel,
        max_seqs: int = 8,
        max_len: int = 8192,
        cuda_graphs: bool | None = None,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        resume_span: int | None = None,
        compile: bool | str | None = None,
    ):
        if not isinstance(model, FastModel):
            raise TypeError("Runner drives a FastModel: pass dsv4.fast.model.make_fast(model)")
        self.model, self.config = model, model.config
        weight = model.embed.weight
        self.state = SlotState(model.config, max_seqs, max_len, weight.dtype, weight.device, model.quant_sim, resume_span)
        self.cuda_graphs = weight.is_cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not weight.is_cuda:
            raise ValueError("cuda_graphs needs the model on a CUDA device")
        compile = weight.is_cuda if compile is None else compile
        backend = compile if isinstance(compile, str) else "inductor"
        # the step decode runs and captures (what a profiler of the step should call too)
        self.step = model.compile_decode(backend) if compile else model.decode_step
        self.compiled = bool(compile)
        if compile:
            model.compile_prefill(backend)
        self.batch_sizes = sorted({b for b in batch_sizes if b < max_seqs} | {max_seqs})
        self._free = list(range(max_seqs))
        self._in_use = [False] * max_seqs  # allocated: what every call naming a slot checks first
        # host mirrors of state.lengths and state.window_start: bounds checks, and what a prefill's
        # SlotCache starts from without reading the device
        self._length = [0] * max_seqs
        self._window_start = [0] * max_seqs
        # what the overlapping compressors' rings hold (V4): the group before every group boundary from
        # `_held_from` to the slot's end (decode steps write each position), and before the ends of
        # earlier prefill forwards (`_marks`), while within resume_span; a prefill forward writes only
        # the last groups it reaches, so a slot can be resumed at no other point
        self._held_from = [0] * max_seqs
        self._stepped = [False] * max_seqs  # the slot's last position came from a decode step (drop_last's)
        self._marks: list[set[int]] = [set() for _ in range(max_seqs)]
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._replay_graph: tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def for_memory(cls, model: FastModel, memory_bytes: int, max_len: int = 8192, resume_span: int | None = None,
                   **kwargs) -> Runner:
        """As many slots of `max_len` tokens as `memory_bytes` holds, the scratch slot included."""
        weight = model.embed.weight
        per_slot = SlotState.bytes_per_slot(model.config, max_len, weight.dtype, model.quant_sim, resume_span)
        if memory_bytes < 2 * per_slot:
            raise ValueError(f"{memory_bytes} bytes hold no sequence slot of {max_len} tokens "
                             f"({per_slot} bytes each, and one more for the scratch slot)")
        return cls(model, memory_bytes // per_slot - 1, max_len, resume_span=resume_span, **kwargs)

    # ------------------------------------------------------------------ slots
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots(f"all {self.state.max_seqs} sequence slots are in use")
        slot = self._free.pop(0)
        self._in_use[slot] = True
        self.state.clear(slot)
        self._start_over(slot, 0)
        return slot

    def release(self, slot: int) -> None:
        slot = self._allocated(slot)
        self._in_use[slot] = False
        self._free.append(slot)

    def _allocated(self, slot) -> int:
        """`slot` as the index of an allocated sequence slot; a ValueError names any other (out of range, free,
        or released: a call on it would read or write a slot no sequence owns)."""
        index = operator.index(slot)
        if not 0 <= index < self.state.max_seqs or not self._in_use[index]:
            raise ValueError(f"slot {slot} is not allocated (slots are 0..{self.state.max_seqs - 1}, from allocate())")
        return index

    def length(self, slot: int) -> int:
        return self._length[slot]

    # ------------------------------------------------------------------ prefill and replay
    def prefill(self, slot: int, ids: Sequence[int] | torch.Tensor, start_pos: int | None = None) -> torch.Tensor:
        """Run ids (the tokens at start_pos.., default: the slot's end) -> logits [vocab] of the last one."""
        slot = self._allocated(slot)
        return self._forward(slot, self._upload(ids), self._length[slot] if start_pos is None else start_pos)

    @torch.inference_mode()
    def _forward(self, slot: int, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The module path over ids [1, S] (on the device, checked) at positions start.. of the slot."""
        held = self._length[slot]
        cache = SlotCache(self.state, slot, held, self._window_start[slot])
        hidden = self.model.hidden_states(ids, cache=cache, start_pos=start)
        self._length[slot] = start + ids.shape[1]
        self._stepped[slot] = False
        self._window_start[slot] = cache.window_start
        # the compressors skip a replay's positions (below what the slot held): they start at `held`
        self._rings_written(slot, max(start, held), self._length[slot])
        return self.model.logits(hidden[0, -1])

    def _upload(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Prompt ids -> [1, S] on the device, checked (`check_token_ids`). Host ids are checked on the host
        and copied from pinned memory, so the host does not wait for the device to drain (a check of
        device ids has to)."""
        ids = (ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids, dtype=torch.int64)).reshape(1, -1)
        if not ids.numel():
            raise ValueError("an empty prompt: a forward needs at least one token")
        self.model.check_token_ids(ids)
        return self.to_device(ids)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor on the runner's device. Host tensors go through pinned memory: a copy from pageable
        memory waits for the device's queue to drain, so the host could not prepare the next step meanwhile."""
        if t.device.type != "cpu" or self.state.device.type != "cuda":
            return t.to(self.state.device)
        return t.pin_memory().to(self.state.device, non_blocking=True)

    def _rings_written(self, slot: int, start: int, end: int) -> None:
        """A forward over [start, end) wrote the raw projections of [g - ratio, end) to the overlapping
        compressors' rings (the last finished group and the unfinished one)."""
        r = self.state.overlap_ratio
        if r is None:
            return
        g = end - end % r
        if g - r > start:  # not contiguous with what the rings held before
            self._held_from[slot] = g
        self._marks[slot] = {m for m in self._marks[slot] if end - m <= self.state.resume_span} | {g}

    def resumable(self, source: int, length: int) -> bool:
        """Whether `restore` can start a slot from `source`'s first `length` tokens."""
        return self._resume_problem(source, length) is None

    def _resume_problem(self, source: int, length: int) -> str | None:
        W, end = self.config.sliding_window, self._length[self._allocated(source)]
        if length < W or length > end:
            return f"a bounded replay resumes {W}..{end} tokens, not {length}"
        ratios = self.config.compression_ratios
        if any(length % r for r in ratios):
            return f"resume at a multiple of every compression ratio {sorted(ratios)}, not {length}"
        # overlapping compressors need the raw projections of the group before `length`
        span = self.state.resume_span
        if span is not None and end - length > span:
            return (f"slot {source} has moved {end - length} tokens past {length}, beyond the resume span of {span}: "
                    "its overlapping compressors no longer hold that prefix's last group")
        if span is not None and length < self._held_from[source] and length not in self._marks[source]:
            return (f"slot {source} passed position {length} inside a prefill forward: its overlapping compressors "
                    "never held that prefix's last group")
        return None

    @torch.inference_mode()
    def restore(self, slot: int, source: int, length: int) -> None:
        """Give `slot` `source`'s first `length` tokens as a prefix-cache hit does under SWA bounded replay
        (`dsv4.reference.model.bounded_replay_state`): the compressed KV, index keys and carries, and empty
        windows; `prefill` the last `sliding_window` of those tokens at `length - sliding_window` next to
        rebuild the windows. `slot` may be `source` (taken over in place)."""
        slot = self._allocated(slot)
        problem = self._resume_problem(source, length)
        if problem is not None:
            raise ValueError(problem)
        self.state.copy_prefix(source, slot, length)
        self._start_over(slot, length)

    def _start_over(self, slot: int, length: int) -> None:
        """The host mirrors of a slot that holds `length` tokens from a fresh start or a restored prefix."""
        self._length[slot] = self._window_start[slot] = self._held_from[slot] = length
        self._marks[slot] = set()
        self._stepped[slot] = False

    def resume(self, slot: int, source: int, length: int,
               ids: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor | None:
        """`restore`, then the bounded replay of the window before `length`: with `ids` (the tokens at length..,
        as `prefill` takes them) in one forward with them -> logits [vocab] of their last position (the 128
        replayed tokens cost little more inside a prefill that reads every weight anyway); without, as `replay`
        (None)."""
        self.restore(slot, source, length)
        if ids is None:
            self.replay(slot)
            return None
        W = self.config.sliding_window
        window = self.state.tokens[slot, length - W : length][None]  # the slot's own, checked when first prefilled
        return self._forward(slot, torch.cat([window, self._upload(ids)], dim=1), length - W)

    @torch.inference_mode()
    def replay(self, slot: int) -> None:
        """Rebuild the windows of a slot just `restore`d (at its length): the decode step over the W positions
        before the length, every row the slot's (`FastModel.decode_step`'s replay), one graph replay."""
        slot = self._allocated(slot)
        W, length = self.config.sliding_window, self._length[slot]
        if self._window_start[slot] != length or length < W:
            raise ValueError(f"slot {slot} holds no restored prefix to replay (restore one first)")
        ids = self.state.tokens[slot, length - W : length]  # [W]: the slot's own, checked when first prefilled
        slots = torch.full((W,), slot, device=self.state.device)
        start = self.state.lengths[slot : slot + 1] - W  # [1], on the device: restore wrote the length there
        if not self.cuda_graphs:
            self.step(ids, slots, self.state, replay_from=start)
        else:
            graph, static_ids, static_slots, static_start = self._replay_step_graph()
            static_ids.copy_(ids)
            static_slots.copy_(slots)
            static_start.copy_(start)
            graph.replay()
        self._window_start[slot] = length - W

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def decode(self, slots: Sequence[int], ids: torch.Tensor) -> torch.Tensor:
        """One new token per slot: ids [B] (on the host or the device) -> logits [B, vocab] fp32 (valid until
        the next decode). Nothing here waits for the device."""
        B = len(slots)
        if ids.shape != (B,):
            raise ValueError(f"decode takes one token id per slot: {B} slots, ids of shape {tuple(ids.shape)}")
        if len(set(slots)) != B:
            raise ValueError(f"decode takes each slot once, got slots {list(slots)}")
        self.model.check_token_ids(ids, values=ids.device.type == "cpu")  # device ids (sampled): no wait
        for slot in slots:
            self._allocated(slot)
            if self._length[slot] >= self.state.max_len:
                raise ValueError(f"slot {slot} is full: max_len is {self.state.max_len}")
            if self._length[slot] == 0:
                raise ValueError(f"slot {slot} has no prompt: prefill it first")
        size = next((b for b in self.batch_sizes if b >= B), None)
        if size is None:
            raise ValueError(f"a decode batch of {B} exceeds max_seqs {self.state.max_seqs}")
        for slot in slots:
            self._length[slot] += 1
            self._stepped[slot] = True
        slot_ids = torch.tensor(list(slots))
        if not self.cuda_graphs:
            padded_slots = self.to_device(F.pad(slot_ids, (0, size - B), value=self.state.scratch))
            return self.step(F.pad(self.to_device(ids), (0, size - B)), padded_slots, self.state)[:B]
        graph, static_ids, static_slots, logits = self._graph(size)
        write_padded(static_ids, ids, 0)  # padding rows decode token 0 in the scratch slot
        write_padded(static_slots, slot_ids, self.state.scratch)
        graph.replay()
        return logits[:B]

    def drop_last(self, slot: int) -> None:
        """Forget the slot's last position (a decode step run ahead for a sequence that had stopped). What that
        step wrote stays until the position is computed again, and nothing reads it before: compressed rows and
        index keys are read up to the slot's length, and the rows it overwrote in rings of raw projections (2
        ratios or more back) and in the window (a window back) are older than any later step reads. One decode
        step only: after two, the second's window write would have replaced a row the first position reads."""
        slot = self._allocated(slot)
        end, span = self._length[slot], self.state.resume_span
        if not self._stepped[slot]:
            raise ValueError(f"slot {slot}'s last position is not a decode step's (or one was dropped already)")
        self._stepped[slot] = False
        self._length[slot] = end - 1
        self.state.lengths[slot].fill_(end - 1)
        if span is not None:  # the rings moved on to `end`: the group before a boundary more than span back is gone
            self._held_from[slot] = max(self._held_from[slot], end - span)
            self._marks[slot] = {m for m in self._marks[slot] if end - m <= span and m < end}

    def warm_up(self, max_batch: int, replay: bool = True) -> None:
        """Compile and capture now what would otherwise compile on first use, stalling that request, as an engine
        does at start-up: the prefill's pieces for every chunk length, the decode graphs (`capture`) and, with
        `replay` (an engine whose prefix hits replay windows), the bounded replay's."""
        if self.compiled:
            self._compile_prefill_lengths()
        self.capture(max_batch)
        if replay and self.cuda_graphs:
            self._replay_step_graph()

    def capture(self, max_batch: int) -> None:
        """Capture now the decode graphs that batches of up to `max_batch` sequences use (each compiles and
        captures on first use otherwise, stalling that step)."""
        if self.cuda_graphs:
            for size in self.batch_sizes:
                self._graph(size)
                if size >= max_batch:
                    break

    def _compile_prefill_lengths(self) -> None:
        """Prefills of 2, 3 and 1 tokens (those a slot holds), each in a slot released after: the pieces compile for
        the first length, then with the length as a symbol (every later length but one), and for one token (a size
        torch specializes)."""
        for n in [n for n in (2, 3, 1) if n <= self.state.max_len]:
            slot = self.allocate()
            self.prefill(slot, [0] * n)
            self.release(slot)

    def _replay_step_graph(self):
        """The replay step over W rows, captured once: its ids, slots and start are copied in before each replay."""
        if self._replay_graph is None:
            W, dev = self.config.sliding_window, self.state.device
            ids = torch.zeros(W, dtype=torch.int64, device=dev)
            slots = torch.full((W,), self.state.scratch, device=dev)
            start = torch.zeros(1, dtype=torch.int64, device=dev)
            graph, _ = self._capture(lambda: self.step(ids, slots, self.state, replay_from=start))
            self._replay_graph = (graph, ids, slots, start)
        return self._replay_graph

    def _capture(self, run):
        """(a CUDA graph of run(), what the captured run returned); run() compiles its kernels and warms the
        allocator on a side stream first, outside the capture."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        return graph, out

    def _graph(self, size: int):
        if size not in self._graphs:
            ids = torch.zeros(size, dtype=torch.int64, device=self.state.device)
            slots = torch.full((size,), self.state.scratch, device=self.state.device)
            graph, logits = self._capture(lambda: self.step(ids, slots, self.state))
            self._graphs[size] = (graph, ids, slots, logits)
        return self._graphs[size]
