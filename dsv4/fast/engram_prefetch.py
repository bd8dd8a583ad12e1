"""Host-resident Engram tables and their asynchronous prefetch to the GPU.

V4.1's two Engram tables are ~98 GB each: they stay in host memory, and each token needs 24 rows of
264 B per Engram layer (256 e4m3 values + 8 e8m0 scales). The row ids depend only on token ids, so
all of a step's rows can be fetched at forward entry, while the embedding and layers 0..13 compute.

`HostEngramTable(rows)` / `HostEngramTable.from_tensors(weight, scale)` / `.from_embedding(embed)`
    One layer's table as uint8 [rows, 264] (values then scales, one contiguous 264 B record per row, so
    a row is one read). Memory, in order of preference (`mode="auto"`), recorded in `.mode`:
      "thp-registered": an anonymous mmap with madvise(MADV_HUGEPAGE) (2 MB pages: far fewer TLB and
                        IOMMU misses for random reads of a 100 GB table), pinned afterwards with
                        cudaHostRegister(portable | mapped) so the GPU can read it;
      "registered":     the same mmap without the huge-page advice (4 KB pages), registered;
      "pinned":         torch.empty(pin_memory=True) (cudaHostAlloc, 4 KB pages), when registration
                        fails (note: torch's caching host allocator may round the size up to a power
                        of two, so "auto" tries the exact-size mappings first);
      "pageable":       plain memory, without CUDA (the CPU path).
    `.thp_kb` is the AnonHugePages the kernel reports for the mapping (0 when THP did not take).
    Loading copies the checkpoint tensors (e.g. memory-mapped safetensors) in row chunks straight into
    the table, so the 98 GB never exist twice.

`EngramPrefetcher(tables, device, max_tokens=8192, dtype=bf16, stream=None, programs=None)`
    `start(hash_ids [B, S, L, C])`: at forward entry. On CUDA it makes a side stream wait for the
    current (main) stream - the ids are ready and the previous step no longer reads the buffers - and
    launches, per layer, the UVA gather kernel (`dsv4.fast.kernels.engram.engram_gather`): the GPU
    reads the needed rows from pinned host memory over PCIe and writes dequantized rows into a
    persistent device buffer, then records the layer's event. The host never waits.
    `wait(layer) -> rows [B, S, C, 256]`: the current stream waits on that layer's event (a GPU-side
    wait); the rows stay valid until the next `start`.
    Without CUDA, `start` gathers synchronously into the same kind of persistent buffers (the tests).

Why the UVA gather rather than a host index_select into a pinned staging buffer + an async copy:
  * the ids are computed on the GPU (from sampled tokens); a host gather needs them on the host first,
    i.e. a device->host copy and a host wait on the main stream every step, which stalls the launch
    queue; the UVA kernel keeps everything stream-ordered;
  * one launch per layer (no host thread doing random 264 B reads from a 100 GB table at ~1 row per
    DRAM latency, then a second copy over PCIe): the GPU keeps thousands of PCIe reads in flight;
  * dequantization is fused into the same kernel.
  The cost is SMs borrowed from the main stream while the reads are in flight; the kernel uses a small
  grid (a few rows per program, 4 warps), and bench/engram.py measures how much of the lookup hides.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Sequence

import torch

from dsv4.fast.kernels.engram import ROW_BYTES, ROW_SCALES, ROW_VALUES, engram_gather

_HUGE = 2 << 20
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2
LOAD_CHUNK_ROWS = 1 << 18  # 66 MB per copy chunk


def thp_setting() -> str:
    """The kernel's THP policy ("always", "madvise", "never"), or "unavailable"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def anon_huge_kb(address: int, length: int) -> int:
    """AnonHugePages (kB) of the mappings overlapping [address, address + length) in /proc/self/smaps."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < address + length and hi > address
                elif inside and line.startswith("AnonHugePages:"):
                    total += int(line.split()[1])
    except OSError:
        return 0
    return total


class HostEngramTable:
    """One Engram layer's table in host memory: uint8 [rows, 264] (e4m3 values, then e8m0 scales)."""

    def __init__(self, rows: int, mode: str = "auto", madvise_only: bool = False):
        if mode not in ("auto", "thp", "registered", "pinned", "pageable"):
            raise ValueError(f"HostEngramTable: mode {mode!r} is not auto/thp/registered/pinned/pageable")
        self.rows, self.nbytes = rows, rows * ROW_BYTES
        self.mode, self.thp_kb, self.notes = "", 0, []
        self._mmap, self._registered_ptr = None, None
        cuda = torch.cuda.is_available()
        data = None
        if mode in ("auto", "thp") and cuda:
            data = self._try_register(huge=True)
        if data is None and mode in ("auto", "registered") and cuda:
            data = self._try_register(huge=False)
        if data is None and mode in ("auto", "thp", "registered", "pinned") and cuda:
            data = torch.empty(rows, ROW_BYTES, dtype=torch.uint8, pin_memory=True)
            self.mode = "pinned"
        if data is None:
            if mode == "pinned":
                raise RuntimeError("HostEngramTable: mode 'pinned' needs CUDA")
            data = torch.empty(rows, ROW_BYTES, dtype=torch.uint8)
            self.mode = "pageable"
        self.data = data

    def _try_register(self, huge: bool) -> torch.Tensor | None:
        """An anonymous mmap (madvised to huge pages when `huge`), pinned with cudaHostRegister."""
        if huge and (not hasattr(mmap, "MADV_HUGEPAGE") or thp_setting() in ("never", "unavailable")):
            self.notes.append(f"THP unavailable (setting {thp_setting()})")
            return None
        length = -(-max(self.nbytes, 1) // _HUGE) * _HUGE
        try:
            mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if huge:
                mm.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError) as e:
            self.notes.append(f"mmap/madvise failed: {e}")
            return None
        data = torch.frombuffer(mm, dtype=torch.uint8, count=self.nbytes).view(self.rows, ROW_BYTES)
        ptr = data.data_ptr()
        # madvise only applies to pages faulted later: registration faults (and pins) them now, as huge pages
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(ptr, length, _CUDA_HOST_REGISTER_PORTABLE_MAPPED)
        if int(err) != 0:
            self.notes.append(f"cudaHostRegister failed: error {int(err)}")
            del data
            try:
                mm.close()
            except BufferError:
                pass
            return None
        self._mmap, self._registered_ptr = mm, ptr
        self.mode = "thp-registered" if huge else "registered"
        self.thp_kb = anon_huge_kb(ptr, length)
        return data

    @property
    def is_pinned(self) -> bool:
        return self.mode in ("pinned", "registered", "thp-registered")

    def close(self) -> None:
        """Unregister the THP mapping (pinned tensors free themselves). No kernel may still read it."""
        if self._registered_ptr is not None and torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self._registered_ptr = None

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown: the CUDA runtime may be gone
            self.close()

    # -------------------------------------------------------------------------------- loading
    def load_(self, weight: torch.Tensor, scale: torch.Tensor, chunk_rows: int = LOAD_CHUNK_ROWS) -> HostEngramTable:
        """Copy weight [rows, 256] e4m3 and scale [rows, 8] e8m0 (e.g. memory-mapped) in row chunks."""
        if tuple(weight.shape) != (self.rows, ROW_VALUES) or tuple(scale.shape) != (self.rows, ROW_SCALES):
            raise ValueError(
                f"HostEngramTable.load_: expected weight [{self.rows}, {ROW_VALUES}] and scale "
                f"[{self.rows}, {ROW_SCALES}], got {list(weight.shape)} and {list(scale.shape)}"
            )
        for lo in range(0, self.rows, chunk_rows):
            hi = min(lo + chunk_rows, self.rows)
            self.data[lo:hi, :ROW_VALUES].copy_(weight[lo:hi].view(torch.uint8))
            self.data[lo:hi, ROW_VALUES:].copy_(scale[lo:hi].view(torch.uint8))
        return self

    @classmethod
    def from_tensors(cls, weight: torch.Tensor, scale: torch.Tensor, mode: str = "auto") -> HostEngramTable:
        return cls(weight.shape[0], mode).load_(weight.cpu(), scale.cpu())

    @classmethod
    def from_embedding(cls, embed, mode: str = "auto") -> HostEngramTable:
        """From a `dsv4.reference.engram.EngramEmbedding` (head_dim 256)."""
        return cls.from_tensors(embed.weight.data, embed.scale.data, mode)


class EngramPrefetcher:
    """Fetches every Engram layer's rows at forward entry; `wait(layer)` hands them to the main stream."""

    def __init__(
        self,
        tables: Sequence[HostEngramTable | torch.Tensor],
        device: torch.device | str,
        max_tokens: int = 8192,
        dtype: torch.dtype = torch.bfloat16,
        stream: torch.cuda.Stream | None = None,
        programs: int | None = None,
    ):
        self.tables = [t.data if isinstance(t, HostEngramTable) else t for t in tables]
        self.device = torch.device(device)
        if self.device.type == "cuda":
            for t in tables:
                pinned = t.is_pinned if isinstance(t, HostEngramTable) else (t.is_cuda or t.is_pinned())
                if not pinned:
                    raise ValueError("EngramPrefetcher: on CUDA the tables must be pinned host memory or on the GPU")
        self.dtype = dtype
        self.programs = programs  # gather kernel grid cap (None: one program per SM)
        self.cuda = self.device.type == "cuda"
        self.max_tokens = max_tokens
        self.buffers: list[torch.Tensor] = []  # per layer, [max_tokens * C * 256], allocated once
        self._columns = None
        self._shape = None
        if self.cuda:
            self.stream = stream or torch.cuda.Stream(self.device)
            self.events = [torch.cuda.Event() for _ in self.tables]
        else:
            self.stream, self.events = None, [None] * len(self.tables)

    def _ensure(self, tokens: int, columns: int) -> None:
        if self._columns != columns or tokens > self.max_tokens:
            # a longer chunk than planned grows the buffers once (they stay at the larger size)
            self.max_tokens = max(self.max_tokens, tokens)
            self._columns = columns
            self.buffers = [
                torch.empty(self.max_tokens * columns * ROW_VALUES, dtype=self.dtype, device=self.device)
                for _ in self.tables
            ]

    def start(self, hash_ids: torch.Tensor) -> None:
        """hash_ids [B, S, L, C] int64 (on `device`): launch every layer's gather; returns at once."""
        B, S, L, C = hash_ids.shape
        if L != len(self.tables):
            raise ValueError(f"EngramPrefetcher.start: hash_ids has {L} layers, {len(self.tables)} tables")
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            # the side stream waits for the ids, and for the previous step's readers of the buffers
            self.stream.wait_stream(main)
            with torch.cuda.stream(self.stream):
                self._ensure(B * S, C)
                for layer, table in enumerate(self.tables):
                    engram_gather(table, hash_ids[:, :, layer], out=self.buffers[layer], programs=self.programs)
                    self.events[layer].record(self.stream)
            hash_ids.record_stream(self.stream)
        else:
            self._ensure(B * S, C)
            for layer, table in enumerate(self.tables):
                engram_gather(table, hash_ids[:, :, layer], out=self.buffers[layer])
        self._shape = (B, S, C, ROW_VALUES)

    def wait(self, layer: int) -> torch.Tensor:
        """Rows of `layer`, [B, S, C, 256] in `dtype`; the current stream waits on the gather's event."""
        if self._shape is None:
            raise RuntimeError("EngramPrefetcher.wait before start")
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.events[layer])
        n = 1
        for d in self._shape:
            n *= d
        return self.buffers[layer][:n].view(self._shape)
