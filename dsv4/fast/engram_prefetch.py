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

`keep_engram_on_host(model, mode="auto")`
    Moves every Engram layer's table of a loaded model (still on the host: before `model.to("cuda")`)
    into a `HostEngramTable` and makes its `engram.embed` a `HostEngramEmbedding`: `weight` and `scale`
    (the checkpoint's names) become views of the table's records, `Module.to` leaves them in host memory,
    and a lookup gathers on the device the ids are on. `make_fast` then gives the model an
    `EngramPrefetcher` over the tables, which its decode steps and prefill forwards start at entry and wait
    for at the Engram layers (`rows_for`: the rows of exactly the ids the forward started); a forward longer
    than the buffers (`max_tokens`) gathers at each Engram layer on the main stream.

`EngramPrefetcher(tables, device, max_tokens=8192, dtype=bf16, stream=None, programs=None)`
    `start(hash_ids [B, S, L, C], hold=False)`: at forward entry. On CUDA it makes a side stream wait for the
    current (main) stream - the ids are ready and the previous step no longer reads the buffers - and
    launches one UVA gather kernel (`dsv4.fast.kernels.engram`) for up to four layers: the GPU reads the
    needed rows from pinned host memory over PCIe and writes dequantized rows into a
    persistent device buffer, then records one event. The host never waits (~15 us of host time).
    `wait(layer) -> rows [B, S, C, 256]`: the current stream waits on that layer's event (a GPU-side
    wait); the rows are views of the persistent buffers, valid until the next `start` or the next replay of
    a decode graph that captured one. `rows_for(layer, row_ids, dtype)`: `wait(layer)` when row_ids is that
    layer's slice of the ids a `start(..., hold=True)` got (a module-path forward's Engram layers), else None.
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

from dsv4.fast.kernels import use_triton
from dsv4.fast.kernels.engram import (
    MAX_TABLES,
    ROW_BYTES,
    ROW_SCALES,
    ROW_VALUES,
    default_programs,
    engram_gather,
    engram_gather_twin,
    gather_args,
    gather_grid,
    launch_gather,
)
from dsv4.reference.engram import EngramEmbedding

_HUGE = 2 << 20
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2
LOAD_CHUNK_ROWS = 1 << 18
# gather programs of the prefetch (at most): the side-stream gather holds its SMs while the main stream's kernels
# want them all. H200 sweep, a 2048-token chunk behind 17 ms of compute (`engram-programs*.json`): 4 / 8 / 16 / 32
# programs hid 90 / 84-86 / 75 / 57% of the lookup, which took 6.0 / 3.2 / 2.8 / 2.9 ms; 8 hides nearly what 4
# does at half its lookup time (a 64-token decode lookup: 100 us, well inside the layers before an Engram layer)
PREFETCH_PROGRAMS = 8


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


def cuda_runtime_paths(maps_lines) -> list[str]:
    """The CUDA runtime libraries (libcudart*.so*, hashed wheel names too) among /proc/<pid>/maps lines, whose
    sixth field is the path (it may hold spaces; a replaced file ends in " (deleted)")."""
    fields = (line.rstrip("\n").split(None, 5) for line in maps_lines)
    return sorted({f[5].removesuffix(" (deleted)") for f in fields
                   if len(f) == 6 and "libcudart" in f[5].rsplit("/", 1)[-1] and ".so" in f[5]})


def clear_cuda_error() -> int:
    """Reset the CUDA runtime's last error -> the error it held (0: none).

    A failed runtime call leaves its error as the thread's last error, and torch's next kernel launch check
    (cudaGetLastError) would raise it as that kernel's failure. torch binds no cudaGetLastError, so it is
    called in the libcudart the process has loaded (dlopen of a loaded library returns that same instance)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = cuda_runtime_paths(f)
    except OSError:
        return 0
    errors = []
    for path in paths:
        try:
            errors.append(int(ctypes.CDLL(path).cudaGetLastError()))
        except (OSError, AttributeError):  # gone from the disk, or not a runtime after all
            continue
    return next((e for e in errors if e), 0)


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
            clear_cuda_error()
            del data
            try:
                mm.close()
            except BufferError:  # a view of the mapping is still alive: it closes when that view goes
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


class HostEngramEmbedding(EngramEmbedding):
    """An EngramEmbedding whose table (`table`, a HostEngramTable) stays in host memory whatever device the
    model moves to; `weight` and `scale` are views of the table's records. A lookup gathers on the device
    of the ids: on CUDA the kernel reads the pinned rows over PCIe (no host round trip), on the host the
    twin; or, for the ids a forward's entry started prefetching, returns the prefetch's rows (views of its
    buffers, `EngramPrefetcher.rows_for`). Same rows as EngramEmbedding.forward, bit for bit."""

    table: HostEngramTable
    prefetch: EngramPrefetcher | None = None  # the model's, when make_fast attached one (this is its layer `index`)
    index: int = 0

    def _apply(self, fn, recurse=True):  # Module.to / .cuda / .half: the table stays where and what it is
        return self

    def forward(self, row_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = self.prefetch.rows_for(self.index, row_ids, dtype) if self.prefetch is not None else None
        return rows if rows is not None else engram_gather(self.table.data, row_ids, dtype=dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # the gathers read the table: load_state_dict (assign=True too) copies into it, the views stay views
        for hook in self._load_state_dict_pre_hooks.values():
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if strict:  # as Module._load_from_state_dict: a key under this module's prefix that names nothing
            unexpected_keys += [k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in
                                ("weight", "scale")]
        loaded = {}
        for name, dtype in (("weight", torch.float8_e4m3fn), ("scale", torch.float8_e8m0fnu)):
            value = state_dict.get(prefix + name)
            if value is None:
                missing_keys.append(prefix + name)
            elif value.dtype != dtype:
                error_msgs.append(f"{prefix}{name}: dtype {value.dtype}, expected {dtype}")
            else:
                loaded[name] = value.detach().cpu()
        if len(loaded) == 2:
            try:
                self.table.load_(loaded["weight"], loaded["scale"])
            except ValueError as e:
                error_msgs.append(f"{prefix[:-1]}: {e}")


def keep_engram_on_host(model, mode: str = "auto") -> list[HostEngramTable]:
    """Every Engram layer's table of `model` into host memory (see the module doc) -> the tables, in
    Engram layer order."""
    embeds = [layer.engram.embed for layer in model.layers if layer.role.engram]
    widths = sorted({e.embedding_dim for e in embeds} - {ROW_VALUES})
    if widths:  # before any table moves: all of them or none
        raise ValueError(f"host Engram tables hold rows of {ROW_VALUES} values, not {widths}")
    tables = []
    for embed in embeds:
        if not isinstance(embed, HostEngramEmbedding):
            table = HostEngramTable.from_embedding(embed, mode)
            embed.__class__ = HostEngramEmbedding
            embed.table = table
            embed.weight = torch.nn.Parameter(table.data[:, :ROW_VALUES].view(torch.float8_e4m3fn), False)
            embed.scale = torch.nn.Parameter(table.data[:, ROW_VALUES:].view(torch.float8_e8m0fnu), False)
        tables.append(embed.table)
    return tables


class EngramPrefetcher:
    """Fetches every Engram layer's rows at forward entry; `wait(layer)` hands them to the main stream.

    Host cost of `start()` on CUDA (it sits on the decode critical path): one event record on the main
    stream, one event wait on the side stream, one gather launch for up to four tables (the ids of all
    layers are read from hash_ids in place), one event record, `record_stream` of the ids. The launch
    goes straight to Triton's compiled kernel with precomputed arguments and the side stream's handle
    (no stream context switch, no argument binding); the first launch after (re)allocation takes the
    ordinary JIT path, which compiles and returns that kernel. `start`/`wait` make no host syncs and
    allocate nothing once the buffers exist, so they can also be captured in a CUDA graph."""

    def __init__(
        self,
        tables: Sequence[HostEngramTable | torch.Tensor],
        device: torch.device | str,
        max_tokens: int = 8192,
        dtype: torch.dtype = torch.bfloat16,
        stream: torch.cuda.Stream | None = None,
        programs: int | None = None,
        fast_launch: bool = True,
    ):
        self.tables = [t.data if isinstance(t, HostEngramTable) else t for t in tables]
        # the HostEngramTables own their mappings and registrations: they live as long as the gathers
        self._owners = [t for t in tables if isinstance(t, HostEngramTable)]
        self.device = torch.device(device)
        if self.device.type == "cuda":
            for t in tables:
                pinned = t.is_pinned if isinstance(t, HostEngramTable) else (t.is_cuda or t.is_pinned())
                if not pinned:
                    raise ValueError("EngramPrefetcher: on CUDA the tables must be pinned host memory or on the GPU")
        self.dtype = dtype
        self.programs = programs  # gather kernel grid cap (None: PREFETCH_PROGRAMS, at most one per SM)
        self.cuda = self.device.type == "cuda"
        self.max_tokens = max_tokens
        self.buffers: list[torch.Tensor] = []  # per layer, [max_tokens * C * 256], views of one allocation
        self._flat = None
        self._columns = None
        self._shape = None
        # launch groups: (first layer, tables) of at most MAX_TABLES tables each
        self._groups = [(lo, self.tables[lo : lo + MAX_TABLES]) for lo in range(0, len(self.tables), MAX_TABLES)]
        self._compiled: list = [None] * len(self._groups)  # Triton kernels for the direct launch
        self._arg_cache: list = [None] * len(self._groups)
        self._views, self._views_key = [], None  # wait()'s results for the current shape
        self._fast = fast_launch and self.cuda
        if self.cuda:
            self.stream = stream or torch.cuda.Stream(self.device)
            self._stream_handle = self.stream.cuda_stream
            self._ready = torch.cuda.Event()  # main stream: ids written, previous readers done
            self._done = torch.cuda.Event()  # side stream: every layer's rows written
            self.events = [self._done] * len(self.tables)  # one launch fills every layer
            self._programs = programs or min(PREFETCH_PROGRAMS, default_programs(self.device))
            self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        else:
            self.stream, self.events = None, [None] * len(self.tables)
            self._programs = programs or default_programs(self.device)
        self._waited = None  # stream handle that already waits on this step's event
        self._captured = False  # a CUDA graph holds the buffers' addresses: they may not move any more
        self._ids = None  # the last start's hash ids when it held them (rows_for identifies them by address)

    def _ensure(self, tokens: int, columns: int) -> None:
        if self._columns != columns or tokens > self.max_tokens:
            if self._captured:  # a graph captured earlier writes and reads the old buffers
                raise RuntimeError(
                    f"EngramPrefetcher: {tokens} tokens x {columns} rows do not fit the buffers "
                    f"({self.max_tokens} x {self._columns}) that CUDA graphs were captured with; "
                    "build the prefetcher with a larger max_tokens")
            # a longer chunk than planned grows the buffers once (they stay at the larger size)
            self.max_tokens = max(self.max_tokens, tokens)
            self._columns = columns
            per = self.max_tokens * columns * ROW_VALUES
            if self._flat is not None and self.cuda:  # a gather still queued on the side stream may write it
                self._flat.record_stream(self.stream)
            with torch.inference_mode(False):  # written in and out of inference mode (a runner's steps, a tool's)
                self._flat = torch.empty(len(self.tables) * per, dtype=self.dtype, device=self.device)
            self.buffers = [self._flat[i * per : (i + 1) * per] for i in range(len(self.tables))]
            self._compiled = [None] * len(self._groups)
            self._arg_cache = [None] * len(self._groups)
            self._views_key = None

    def _args(self, group: int, ids: torch.Tensor, rows: int) -> tuple:
        """Kernel arguments; all but the ids and the row count are built once per buffer allocation."""
        cached = self._arg_cache[group]
        if cached is None:
            lo, tabs = self._groups[group]
            L, C = len(self.tables), self._columns
            full = gather_args(tabs, ids, rows, C, L * C, C, self.buffers[lo], self.buffers[0].numel())
            cached = self._arg_cache[group] = (full[:8], full[9], full[11:])
        head, out, tail = cached
        return (*head, ids, out, rows, *tail)

    def start(self, hash_ids: torch.Tensor, hold: bool = False) -> None:
        """hash_ids [B, S, L, C] int64 (on `device`): launch every layer's gather; returns at once. The
        buffers grow to a longer step's size until a CUDA graph captures a start; from then on a step that
        does not fit them raises (the graph would go on writing the freed ones). `hold` keeps the ids, so that
        `rows_for` knows them (a decode step passes rows itself and holds nothing: its ids live in the graph's
        memory)."""
        B, S, L, C = hash_ids.shape
        if L != len(self.tables):
            raise ValueError(f"EngramPrefetcher.start: hash_ids has {L} layers, {len(self.tables)} tables")
        self._ids = None
        given = hash_ids
        if hash_ids.dtype != torch.int64 or not hash_ids.is_contiguous():
            hash_ids = hash_ids.to(torch.int64).contiguous()
        self._ensure(B * S, C)
        self._ids = given if hold else None
        self._shape = (B, S, C, ROW_VALUES)
        if self._views_key != self._shape:
            n = B * S * C * ROW_VALUES
            self._views = [b[:n].view(self._shape) for b in self.buffers]
            self._views_key = self._shape
        self._waited = None
        R = B * S * C  # rows per layer
        if not self.cuda:
            if use_triton(hash_ids):
                for gi, (lo, tabs) in enumerate(self._groups):
                    ids = hash_ids[:, :, lo:]
                    launch_gather(self._args(gi, ids, R), gather_grid(R, len(tabs), self._programs))
            else:
                for layer, table in enumerate(self.tables):
                    n = R * ROW_VALUES
                    self.buffers[layer][:n].view(self._shape).copy_(
                        engram_gather_twin(table, hash_ids[:, :, layer], self.dtype))
            return
        self._captured |= torch.cuda.is_current_stream_capturing()
        main = torch.cuda.current_stream(self._index)
        # the side stream waits for the ids, and for the previous step's readers of the buffers
        self._ready.record(main)
        self.stream.wait_event(self._ready)
        if R:
            for gi, (lo, tabs) in enumerate(self._groups):
                ids = hash_ids if lo == 0 else hash_ids[:, :, lo:]
                grid = gather_grid(R, len(tabs), self._programs)
                kernel = self._compiled[gi]
                if kernel is not None and ids.data_ptr() % 16 == 0:
                    args = self._args(gi, ids, R)
                    kernel.run(grid, 1, 1, self._stream_handle, kernel.function, kernel.packed_metadata,
                               None, None, None, *args)
                else:
                    with torch.cuda.stream(self.stream):
                        kernel = launch_gather(self._args(gi, ids, R), grid)
                    if self._fast and ids.data_ptr() % 16 == 0 and hasattr(kernel, "packed_metadata"):
                        self._compiled[gi] = kernel  # compiled for 16-aligned ids; R is not specialized
        self._done.record(self.stream)
        if not torch.cuda.is_current_stream_capturing():
            hash_ids.record_stream(self.stream)  # the caller may free the ids before the gather ran

    def fits(self, tokens: int, columns: int) -> bool:
        """Whether a start for `tokens` x `columns` rows fits the buffers as planned (max_tokens), without
        growing them: a long prefill must not leave them large for good (decode graphs capture them)."""
        return tokens <= self.max_tokens and self._columns in (None, columns)

    def rows_for(self, layer: int, row_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """`wait(layer)` if the last start held exactly these ids (row_ids is that start's `layer` slice, the
        very tensor view: the prefetcher holds the ids, so their memory cannot have been reused) in `dtype`;
        else None."""
        if self._ids is None or dtype != self.dtype:
            return None
        mine = self._ids[:, :, layer]
        same = (row_ids.data_ptr(), row_ids.shape, row_ids.stride()) == (mine.data_ptr(), mine.shape, mine.stride())
        return self.wait(layer) if same else None

    def wait(self, layer: int) -> torch.Tensor:
        """Rows of `layer`, [B, S, C, 256] in `dtype`; the current stream waits on the gather's event."""
        if self._shape is None:
            raise RuntimeError("EngramPrefetcher.wait before start")
        if self.cuda:
            cur = torch.cuda.current_stream(self._index)
            if self._waited != cur.cuda_stream:
                cur.wait_event(self._done)
                self._waited = cur.cuda_stream
        return self._views[layer]
